package agent

import (
	"fmt"
	"net"
	"os/exec"
	"runtime"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// startInLoopbackNetns starts cmd in a network namespace of its own that
// holds nothing but an up loopback interface, and returns a listener on
// 127.0.0.1:port inside that namespace: the one address cmd can reach.
// Serve it (the recorder does) to bridge cmd's requests to servers in the
// test's own namespace. port 0 picks a free one; any is free in a new
// namespace. probe addresses are dialled from inside the namespace before
// cmd starts; their errors are returned (nil = reachable) so the caller can
// assert that nothing else is. wait waits for cmd.
//
// It works on one goroutine locked to its OS thread: unshare(CLONE_NEWNET)
// moves only that thread into a new namespace, the listener's and the
// probes' sockets are made on it, and cmd is forked from it (a child
// inherits its parent thread's namespaces). Then the thread goes back to
// the namespace it came from (setns) and is unlocked. It must not simply
// exit locked (which Go allows, discarding the thread): the runtime may
// have forked another child from that thread earlier, and a child started
// with Pdeathsig (testproc does, for compactproxy) is killed when its
// parent thread ends. Go starts new threads from a template thread while
// one is locked, so none inherits the namespace.
//
// Needs CAP_SYS_ADMIN (root, or a user namespace); the caller skips
// without it.
func startInLoopbackNetns(cmd *exec.Cmd, port int, probe []string) (ln net.Listener, probes []error, wait func() error, err error) {
	type started struct {
		ln     net.Listener
		probes []error
		err    error
	}
	ready := make(chan started, 1)
	go func() {
		runtime.LockOSThread()
		home, err := syscall.Open("/proc/thread-self/ns/net", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ready <- started{err: fmt.Errorf("open this thread's network namespace: %w", err)}
			return
		}
		defer syscall.Close(home)
		if err := syscall.Unshare(syscall.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ready <- started{err: fmt.Errorf("unshare(CLONE_NEWNET): %w", err)}
			return
		}
		s := inNewNetns(cmd, port, probe)
		if e := unix.Setns(home, unix.CLONE_NEWNET); e != nil {
			// The thread stays in the new namespace: keep it locked and
			// parked, so that neither another goroutine nor its end can
			// touch anything.
			ready <- started{err: fmt.Errorf("setns back to the test's network namespace: %w", e)}
			select {}
		}
		runtime.UnlockOSThread()
		ready <- s
	}()
	s := <-ready
	if s.err != nil {
		if s.ln != nil {
			s.ln.Close()
		}
		return nil, nil, nil, s.err
	}
	return s.ln, s.probes, cmd.Wait, nil
}

// inNewNetns does the namespace's part of startInLoopbackNetns, on the
// thread that is in it.
func inNewNetns(cmd *exec.Cmd, port int, probe []string) (s struct {
	ln     net.Listener
	probes []error
	err    error
}) {
	if s.err = loopbackUp(); s.err != nil {
		return s
	}
	s.ln, s.err = net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if s.err != nil {
		s.err = fmt.Errorf("listen inside the namespace: %w", s.err)
		return s
	}
	for _, a := range probe {
		c, err := net.DialTimeout("tcp", a, 2*time.Second)
		if err == nil {
			c.Close()
		}
		s.probes = append(s.probes, err)
	}
	s.err = cmd.Start()
	return s
}

// loopbackUp sets IFF_UP on "lo" in the calling thread's network
// namespace (what `ip link set lo up` does), with SIOCGIFFLAGS and
// SIOCSIFFLAGS on a datagram socket.
func loopbackUp() error {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback up: socket: %w", err)
	}
	defer syscall.Close(fd)
	// struct ifreq: the interface name, then a union whose first member
	// here is ifr_flags (short); 40 bytes on 64-bit Linux.
	var ifr struct {
		name  [syscall.IFNAMSIZ]byte
		flags uint16
		_     [22]byte
	}
	copy(ifr.name[:], "lo")
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCGIFFLAGS, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return fmt.Errorf("loopback up: SIOCGIFFLAGS: %w", e)
	}
	ifr.flags |= syscall.IFF_UP
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCSIFFLAGS, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return fmt.Errorf("loopback up: SIOCSIFFLAGS: %w", e)
	}
	return nil
}
