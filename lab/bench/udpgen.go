package bench

// UDP load generators (`palisade bench udp`) and the servers' side: a sink
// that counts datagrams (rate) and an echo (round trips, whose datagram
// count is exact on both ends). Like the TCP clients they use blocking
// system calls on plain descriptors.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// UDPResult is one UDP measurement of one datagram size.
type UDPResult struct {
	Size    int     `json:"size"`
	Sent    int64   `json:"sent"`    // datagrams sent (rate) or round trips done, warm-up included (rr)
	Seconds float64 `json:"seconds"` // sending time
	SendErr int64   `json:"send_errors"`
	// Round trips (rr): median and count measured.
	MedUS float64 `json:"median_us,omitempty"`
	Iters int     `json:"iters,omitempty"`
	CPUNS float64 `json:"cpu_ns"` // this process, user + system
}

// selfCPU is this process's user + system time in ns.
func selfCPU() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return float64(ru.Utime.Nano() + ru.Stime.Nano())
}

// UDPRate sends datagrams of size bytes to addr as fast as one unconnected
// socket can (sendto, so every datagram passes the send hooks) for d.
func UDPRate(addr string, size int, d time.Duration) (UDPResult, error) {
	sa, fam, err := sockaddr(addr)
	if err != nil {
		return UDPResult{}, err
	}
	fd, err := syscall.Socket(fam, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return UDPResult{}, err
	}
	defer syscall.Close(fd)
	msg := make([]byte, size)
	cpu0 := selfCPU()
	t0 := time.Now()
	end := t0.Add(d)
	r := UDPResult{Size: size}
	for {
		for i := 0; i < 64; i++ {
			if err := syscall.Sendto(fd, msg, 0, sa); err != nil {
				// ECONNREFUSED from an earlier ICMP error, ENOBUFS: the
				// datagram is not sent; anything else is a real failure.
				if err == syscall.EINTR || err == syscall.ECONNREFUSED || err == syscall.ENOBUFS || err == syscall.EAGAIN {
					r.SendErr++
					continue
				}
				return r, fmt.Errorf("sendto: %w", err)
			}
			r.Sent++
		}
		if time.Now().After(end) {
			break
		}
	}
	r.Seconds = time.Since(t0).Seconds()
	r.CPUNS = selfCPU() - cpu0
	if r.Sent == 0 {
		return r, fmt.Errorf("no datagram sent (%d send errors)", r.SendErr)
	}
	return r, nil
}

// UDPRoundTrips sends iters datagrams (after a warm-up) to an echo server
// and times each reply; replies are checked byte for byte.
func UDPRoundTrips(addr string, size, iters int) (UDPResult, error) {
	sa, fam, err := sockaddr(addr)
	if err != nil {
		return UDPResult{}, err
	}
	fd, err := syscall.Socket(fam, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return UDPResult{}, err
	}
	defer syscall.Close(fd)
	tv := syscall.Timeval{Sec: 1}
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	msg := make([]byte, size)
	buf := make([]byte, size+1)
	warm := max(iters/10, 5)
	rtts := make([]float64, 0, iters)
	r := UDPResult{Size: size, Iters: iters}
	lost := 0
	cpu0 := selfCPU()
	t0 := time.Now()
	for i := 0; i < warm+iters; i++ {
		for j := range msg {
			msg[j] = byte(i + j)
		}
		ts := time.Now()
		if err := syscall.Sendto(fd, msg, 0, sa); err != nil {
			return r, fmt.Errorf("sendto: %w", err)
		}
		r.Sent++
		for {
			n, _, err := syscall.Recvfrom(fd, buf, 0)
			if err == syscall.EINTR {
				continue
			}
			if err == syscall.EAGAIN {
				// Lost (UDP may lose under load): send the next one.
				if lost++; lost > 10 {
					return r, fmt.Errorf("more than 10 of %d datagrams got no reply", i+1)
				}
				break
			}
			if err != nil {
				return r, fmt.Errorf("recvfrom: %w", err)
			}
			if n != size || string(buf[:n]) != string(msg) {
				continue // a late reply to an earlier datagram
			}
			if i >= warm {
				rtts = append(rtts, float64(time.Since(ts).Nanoseconds())/1e3)
			}
			break
		}
	}
	r.Seconds = time.Since(t0).Seconds()
	r.CPUNS = selfCPU() - cpu0
	if len(rtts) == 0 {
		return r, errors.New("no round trip completed")
	}
	r.MedUS = medianOf(rtts)
	return r, nil
}

// udpCounter counts what the sink received.
type udpCounter struct{ dgrams, bytes atomic.Int64 }

// udpServe binds port on fam (v6 sockets are v6-only, so the v4 socket
// gets the v4 traffic as a C server binding 0.0.0.0 would) and receives
// until done closes; echo sends every datagram back.
func udpServe(fam, port int, echo bool, cnt *udpCounter, done <-chan struct{}) (func(), error) {
	fd, err := syscall.Socket(fam, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	var sa syscall.Sockaddr = &syscall.SockaddrInet4{Port: port}
	if fam == syscall.AF_INET6 {
		_ = syscall.SetsockoptInt(fd, syscall.IPPROTO_IPV6, syscall.IPV6_V6ONLY, 1)
		sa = &syscall.SockaddrInet6{Port: port}
	}
	// Room for bursts: the rate test measures the path, not a tiny buffer.
	_ = syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4<<20)
	tv := syscall.Timeval{Usec: 200000}
	_ = syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	if err := syscall.Bind(fd, sa); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("bind udp port %d: %w", port, err)
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		buf := make([]byte, 65536)
		for {
			select {
			case <-done:
				return
			default:
			}
			n, from, err := syscall.Recvfrom(fd, buf, 0)
			if err != nil {
				continue // timeout, EINTR: look at done again
			}
			if cnt != nil {
				cnt.dgrams.Add(1)
				cnt.bytes.Add(int64(n))
			}
			if echo && from != nil {
				_ = syscall.Sendto(fd, buf[:n], 0, from)
			}
		}
	}()
	return func() { <-stopped; syscall.Close(fd) }, nil
}

// ServeStats is what `palisade bench serve` reports when the bench writes
// "stats" to its stdin: its CPU time and its children's (iperf3), and what
// the UDP sink received.
type ServeStats struct {
	CPUNS      float64 `json:"cpu_ns"`
	ChildCPUNS float64 `json:"children_cpu_ns"`
	UDPRx      int64   `json:"udp_rx"`
	UDPRxBytes int64   `json:"udp_rx_bytes"`
}

// procTaskCPU is the CPU time of every thread of pid in ns (schedstat),
// falling back to /proc/pid/stat (clock ticks).
func procTaskCPU(pid int) float64 {
	t, err := procfs.ThreadsCPU(pid)
	if err != nil {
		return procCPU(pid) * 1e9
	}
	return t
}

// answerStats answers "stats" lines on stdin until EOF.
func answerStats(stdin io.Reader, stdout io.Writer, children func() []int, cnt *udpCounter) {
	sc := bufio.NewScanner(stdin)
	enc := json.NewEncoder(stdout)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) != "stats" {
			continue
		}
		st := ServeStats{CPUNS: selfCPU(), UDPRx: cnt.dgrams.Load(), UDPRxBytes: cnt.bytes.Load()}
		for _, pid := range children() {
			st.ChildCPUNS += procTaskCPU(pid)
		}
		_ = enc.Encode(st)
	}
}
