//go:build !linux

package chat

import "time"

// threadCPUNow is linux-only (getrusage RUSAGE_THREAD).
func threadCPUNow() (time.Duration, bool) { return 0, false }

// threadCPU is linux-only; elsewhere it runs f and reports no
// measurement, and only the allocation bound applies.
func threadCPU(f func()) (time.Duration, bool) { f(); return 0, false }
