package testproc

import (
	"os/exec"
	"syscall"
)

// dieWithTest makes the child get SIGKILL when the test process dies (a
// test timeout panics without running cleanups, which would leave
// the process running).
func dieWithTest(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
