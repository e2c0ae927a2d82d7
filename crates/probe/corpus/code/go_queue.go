package main

import "fmt"

// workQueue is a FIFO of jobs with a per-job retry budget.
type job struct {
	id       int
	attempts int
}

type workQueue struct {
	jobs      []job
	maxTries  int
	completed []int
	dropped   []int
}

func (q *workQueue) enqueue(id int) {
	q.jobs = append(q.jobs, job{id: id})
}

func (q *workQueue) dequeue() (job, bool) {
	if len(q.jobs) == 0 {
		return job{}, false
	}
	next := q.jobs[0]
	q.jobs = q.jobs[1:]
	return next, true
}

func process(id int, attempt int) bool {
	return (id+attempt)%3 != 0
}

func (q *workQueue) drain() int {
	rounds := 0
	for {
		current, ok := q.dequeue()
		if !ok {
			break
		}
		rounds++
		current.attempts++
		if process(current.id, current.attempts) {
			q.completed = append(q.completed, current.id)
		} else if current.attempts < q.maxTries {
			q.jobs = append(q.jobs, current)
		} else {
			q.dropped = append(q.dropped, current.id)
		}
	}
	return rounds
}

func main() {
	q := &workQueue{maxTries: 2}
	for id := 1; id <= 6; id++ {
		q.enqueue(id * 2)
	}
	rounds := q.drain()
	fmt.Printf("%d rounds, done %v, dropped %v\n", rounds, q.completed, q.dropped)
}
