package main

import "fmt"

// tokenBucket allows bursts up to capacity and refills at a steady rate.
type tokenBucket struct {
	capacity   float64
	tokens     float64
	ratePerSec float64
	lastMillis int64
}

func newBucket(capacity, rate float64, now int64) *tokenBucket {
	return &tokenBucket{capacity: capacity, tokens: capacity, ratePerSec: rate, lastMillis: now}
}

func (b *tokenBucket) refill(now int64) {
	elapsed := float64(now-b.lastMillis) / 1000
	b.tokens += elapsed * b.ratePerSec
	if b.tokens > b.capacity {
		b.tokens = b.capacity
	}
	b.lastMillis = now
}

func (b *tokenBucket) allow(now int64, cost float64) bool {
	b.refill(now)
	if b.tokens < cost {
		return false
	}
	b.tokens -= cost
	return true
}

func simulate(bucket *tokenBucket, start int64, requests int, gapMillis int64) int {
	accepted := 0
	now := start
	for i := 0; i < requests; i++ {
		if bucket.allow(now, 1) {
			accepted++
		}
		now += gapMillis
	}
	return accepted
}

func main() {
	bucket := newBucket(5, 2.5, 0)
	burst := simulate(bucket, 0, 10, 10)
	steady := simulate(bucket, 2000, 10, 500)
	fmt.Printf("burst %d of 10, steady %d of 10\n", burst, steady)
}
