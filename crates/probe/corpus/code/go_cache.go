package main

import "fmt"

// lruCache keeps the most recently used entries up to a fixed capacity.
type entry struct {
	key   string
	value int
	prev  *entry
	next  *entry
}

type lruCache struct {
	capacity int
	items    map[string]*entry
	head     *entry
	tail     *entry
	hits     int
}

func newCache(capacity int) *lruCache {
	return &lruCache{capacity: capacity, items: make(map[string]*entry)}
}

func (c *lruCache) unlink(e *entry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		c.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		c.tail = e.prev
	}
}

func (c *lruCache) pushFront(e *entry) {
	e.prev = nil
	e.next = c.head
	if c.head != nil {
		c.head.prev = e
	}
	c.head = e
	if c.tail == nil {
		c.tail = e
	}
}

func (c *lruCache) Get(key string) (int, bool) {
	e, ok := c.items[key]
	if !ok {
		return 0, false
	}
	c.hits++
	c.unlink(e)
	c.pushFront(e)
	return e.value, true
}

func (c *lruCache) Put(key string, value int) {
	if e, ok := c.items[key]; ok {
		e.value = value
		c.unlink(e)
		c.pushFront(e)
		return
	}
	if len(c.items) >= c.capacity {
		oldest := c.tail
		c.unlink(oldest)
		delete(c.items, oldest.key)
	}
	e := &entry{key: key, value: value}
	c.items[key] = e
	c.pushFront(e)
}

func main() {
	cache := newCache(2)
	cache.Put("a", 1)
	cache.Put("b", 2)
	cache.Get("a")
	cache.Put("c", 3)
	_, found := cache.Get("b")
	fmt.Println(found, cache.hits, len(cache.items))
}
