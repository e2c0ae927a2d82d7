type Handler = (params: Record<string, string>) => string;

interface Route {
  pattern: string[];
  handler: Handler;
  hits: number;
}

export class Router {
  private routes: Route[] = [];
  private misses = 0;

  add(path: string, handler: Handler): Router {
    const pattern = splitPath(path);
    this.routes.push({ pattern, handler, hits: 0 });
    return this;
  }

  resolve(path: string): string {
    const parts = splitPath(path);
    for (const route of this.routes) {
      const params = matchRoute(route.pattern, parts);
      if (params !== null) {
        route.hits += 1;
        return route.handler(params);
      }
    }
    this.misses += 1;
    return "404";
  }
}

function splitPath(path: string): string[] {
  return path.split("/").filter((p) => p.length > 0);
}

function matchRoute(pattern: string[], parts: string[]): Record<string, string> | null {
  if (pattern.length !== parts.length) {
    return null;
  }
  const params: Record<string, string> = {};
  for (let i = 0; i < pattern.length; i++) {
    const seg = pattern[i];
    if (seg.startsWith(":")) {
      params[seg.slice(1)] = parts[i];
    } else if (seg !== parts[i]) {
      return null;
    }
  }
  return params;
}

const router = new Router()
  .add("/users/:id", (p) => `user ${p.id}`)
  .add("/users/:id/posts/:post", (p) => `post ${p.post} of ${p.id}`);
console.log(router.resolve("/users/7"), router.resolve("/users/7/posts/42"));
