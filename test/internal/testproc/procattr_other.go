//go:build !linux

package testproc

import "os/exec"

// dieWithTest: only Linux has a parent-death signal; elsewhere a test
// timeout may leave the children running.
func dieWithTest(cmd *exec.Cmd) {}
