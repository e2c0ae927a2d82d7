type Listener<S> = (state: S, previous: S) => void;

interface CounterState {
  count: number;
  step: number;
  history: number[];
}

type Action = { kind: "increment" } | { kind: "decrement" } | { kind: "setStep"; step: number };

function reduce(state: CounterState, action: Action): CounterState {
  switch (action.kind) {
    case "increment":
      return { ...state, count: state.count + state.step, history: [...state.history, state.count] };
    case "decrement":
      return { ...state, count: state.count - state.step, history: [...state.history, state.count] };
    case "setStep":
      return { ...state, step: Math.max(1, action.step) };
  }
}

class Store<S> {
  private listeners: Listener<S>[] = [];

  constructor(private state: S, private reducer: (s: S, a: Action) => S) {}

  dispatch(action: Action): void {
    const previous = this.state;
    this.state = this.reducer(previous, action);
    if (this.state !== previous) {
      this.listeners.forEach((fn) => fn(this.state, previous));
    }
  }

  subscribe(listener: Listener<S>): () => void {
    this.listeners.push(listener);
    return () => {
      this.listeners = this.listeners.filter((l) => l !== listener);
    };
  }
}

const store = new Store<CounterState>({ count: 0, step: 1, history: [] }, reduce);
let changes = 0;
const stop = store.subscribe((state) => {
  changes += 1;
  if (state.count > 5) {
    console.log("count passed five");
  }
});
store.dispatch({ kind: "setStep", step: 3 });
store.dispatch({ kind: "increment" });
store.dispatch({ kind: "increment" });
stop();
store.dispatch({ kind: "decrement" });
console.log(changes);
