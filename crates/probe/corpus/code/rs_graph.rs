use std::collections::VecDeque;

struct Graph {
    adjacency: Vec<Vec<usize>>,
}

impl Graph {
    fn with_nodes(count: usize) -> Self {
        Graph { adjacency: vec![Vec::new(); count] }
    }

    fn connect(&mut self, from: usize, to: usize) {
        self.adjacency[from].push(to);
        self.adjacency[to].push(from);
    }

    fn distances(&self, source: usize) -> Vec<Option<u32>> {
        let mut dist = vec![None; self.adjacency.len()];
        let mut queue = VecDeque::new();
        dist[source] = Some(0);
        queue.push_back(source);
        while let Some(node) = queue.pop_front() {
            let here = dist[node].unwrap_or(0);
            for &next in &self.adjacency[node] {
                if dist[next].is_none() {
                    dist[next] = Some(here + 1);
                    queue.push_back(next);
                }
            }
        }
        dist
    }

    fn components(&self) -> usize {
        let mut seen = vec![false; self.adjacency.len()];
        let mut groups = 0;
        for start in 0..self.adjacency.len() {
            if seen[start] {
                continue;
            }
            groups += 1;
            for (node, d) in self.distances(start).iter().enumerate() {
                if d.is_some() {
                    seen[node] = true;
                }
            }
        }
        groups
    }
}

fn main() {
    let mut graph = Graph::with_nodes(7);
    graph.connect(0, 1);
    graph.connect(1, 2);
    graph.connect(3, 4);
    let far = graph.distances(0).iter().flatten().max().copied();
    println!("components {} farthest {:?}", graph.components(), far);
}
