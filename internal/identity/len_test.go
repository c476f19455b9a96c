package identity

// len returns the number of entries and the bytes they hold.
func (c *parseCache) len() (int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len(), c.bytes
}

// len returns the number of remembered digests.
func (c *digestCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.cur) + len(c.old)
}
