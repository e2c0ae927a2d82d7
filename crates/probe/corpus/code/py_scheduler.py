import heapq


class Scheduler:
    """Runs jobs in priority order, retrying failures a few times."""

    def __init__(self, max_retries=3):
        self.queue = []
        self.counter = 0
        self.max_retries = max_retries
        self.done = []

    def submit(self, job, priority=10):
        self.counter += 1
        heapq.heappush(self.queue, (priority, self.counter, job, 0))

    def _requeue(self, priority, job, attempts):
        self.counter += 1
        penalty = priority + attempts * 5
        heapq.heappush(self.queue, (penalty, self.counter, job, attempts))

    def run(self, budget=100):
        steps = 0
        while self.queue and steps < budget:
            priority, _, job, attempts = heapq.heappop(self.queue)
            steps += 1
            try:
                outcome = job()
            except RuntimeError:
                if attempts + 1 < self.max_retries:
                    self._requeue(priority, job, attempts + 1)
                continue
            self.done.append(outcome)
        return steps


def flaky(limit):
    calls = {"n": 0}

    def job():
        calls["n"] += 1
        if calls["n"] < limit:
            raise RuntimeError("not yet")
        return calls["n"]

    return job


sched = Scheduler()
sched.submit(flaky(2), priority=1)
sched.submit(lambda: 42)
print(sched.run(), sched.done)
