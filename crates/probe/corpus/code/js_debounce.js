// Debounce and throttle helpers with a fake clock for testing.
function createClock() {
  let now = 0;
  const timers = [];
  return {
    now: () => now,
    schedule(delay, fn) {
      timers.push({ at: now + delay, fn });
    },
    advance(ms) {
      now += ms;
      timers.sort((a, b) => a.at - b.at);
      while (timers.length > 0 && timers[0].at <= now) {
        timers.shift().fn();
      }
    },
  };
}

function debounce(clock, wait, action) {
  let pending = 0;
  let lastArgs = null;
  return (...args) => {
    pending += 1;
    const ticket = pending;
    lastArgs = args;
    clock.schedule(wait, () => {
      if (ticket === pending) {
        action(...lastArgs);
      }
    });
  };
}

function throttle(clock, interval, action) {
  let readyAt = 0;
  return (...args) => {
    if (clock.now() < readyAt) {
      return false;
    }
    readyAt = clock.now() + interval;
    action(...args);
    return true;
  };
}

const clock = createClock();
const calls = [];
const save = debounce(clock, 50, (v) => calls.push(v));
save(1);
save(2);
clock.advance(60);
const ping = throttle(clock, 30, (v) => calls.push(v * 10));
ping(3);
ping(4);
clock.advance(40);
ping(5);
console.log(calls);
