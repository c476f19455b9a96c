//go:build !linux

package agent

import (
	"errors"
	"net"
	"os/exec"
)

// errNetnsUnsupported: opencode runs only in a network namespace of its own
// (netns_linux_test.go), which needs Linux; elsewhere its cases skip.
var errNetnsUnsupported = errors.New("network namespaces need Linux")

func startInLoopbackNetns(cmd *exec.Cmd, port int, probe []string) (net.Listener, []error, func() error, error) {
	return nil, nil, nil, errNetnsUnsupported
}
