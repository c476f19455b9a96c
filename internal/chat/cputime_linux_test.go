//go:build linux

package chat

import (
	"runtime"
	"syscall"
	"time"
)

// threadCPUNow is the CPU time the calling OS thread has used so far
// (getrusage RUSAGE_THREAD).
func threadCPUNow() (time.Duration, bool) {
	const rusageThread = 1 // RUSAGE_THREAD, linux
	var r syscall.Rusage
	if syscall.Getrusage(rusageThread, &r) != nil {
		return 0, false
	}
	return time.Duration(r.Utime.Nano() + r.Stime.Nano()), true
}

// threadCPU runs f on one locked OS thread and returns the CPU time that
// thread spent in it: time the parse itself used, which another process on
// a busy machine does not add to, unlike a clock.
func threadCPU(f func()) (time.Duration, bool) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c0, ok0 := threadCPUNow()
	f()
	c1, ok1 := threadCPUNow()
	return c1 - c0, ok0 && ok1
}
