package userwall

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// fakeNetlink stands for netlink.AddrSubscribe: like it, it closes ch when
// done is closed or when the "kernel" ends the subscription (fail).
type fakeNetlink struct {
	mu    sync.Mutex
	calls int
	err   error           // the next subscribe fails with it
	kills []chan struct{} // end each subscription made
	wg    sync.WaitGroup
}

func (f *fakeNetlink) subscribe(ch chan int, done chan struct{}) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.err != nil {
		err := f.err
		f.err = nil
		return err
	}
	kill := make(chan struct{})
	f.kills = append(f.kills, kill)
	f.wg.Add(1)
	go func() { // netlink's receiving goroutine
		defer f.wg.Done()
		defer close(ch)
		select {
		case <-done:
		case <-kill:
		}
	}()
	return nil
}

// fail ends the newest subscription as ENOBUFS does.
func (f *fakeNetlink) fail() {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.kills[len(f.kills)-1])
}

func ready[T any](c <-chan T) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// TestSubscriptionRenewed: a subscription the kernel ended is released (its
// goroutine ends), leaves nothing for a select loop to spin on, and is made
// again at once or after the gap; a failed attempt is retried; stop joins.
func TestSubscriptionRenewed(t *testing.T) {
	f := &fakeNetlink{}
	gap := 50 * time.Millisecond
	s := newSubscription("test", gap, f.subscribe)
	t0 := time.Now()
	if err := s.start(t0); err != nil || s.C() == nil || f.calls != 1 {
		t.Fatalf("start: %v, C %v, %d calls", err, s.C(), f.calls)
	}
	// Ended within the gap: released, renewal scheduled, nothing ready.
	f.fail()
	if _, ok := <-s.C(); ok {
		t.Fatal("the ended subscription delivered an update")
	}
	if err := s.lost(t0.Add(gap / 2)); err != nil {
		t.Fatal(err)
	}
	if s.C() != nil || s.Retry() == nil || f.calls != 1 {
		t.Fatalf("within the gap: C %v Retry %v calls %d, want no channel, a retry, no new call", s.C(), s.Retry(), f.calls)
	}
	if ready(s.C()) {
		t.Fatal("a select on the released channel is ready: the loop would spin")
	}
	<-s.Retry()
	if err := s.due(time.Now()); err != nil || s.C() == nil || f.calls != 2 || s.renewed != 1 {
		t.Fatalf("renewal: %v C %v calls %d renewed %d", err, s.C(), f.calls, s.renewed)
	}
	// Ended after the gap: renewed at once.
	f.fail()
	for range s.C() {
	}
	if err := s.lost(time.Now().Add(gap)); err != nil || s.C() == nil || f.calls != 3 || s.Retry() != nil {
		t.Fatalf("immediate renewal: %v C %v calls %d retry %v", err, s.C(), f.calls, s.Retry())
	}
	// A failed attempt leaves no channel and a retry.
	f.fail()
	for range s.C() {
	}
	f.err = errors.New("ENOMEM")
	if err := s.lost(time.Now().Add(2 * gap)); err == nil || s.C() != nil || s.Retry() == nil {
		t.Fatalf("failed renewal: %v C %v retry %v", err, s.C(), s.Retry())
	}
	<-s.Retry()
	if err := s.due(time.Now()); err != nil || s.C() == nil {
		t.Fatalf("retry after a failure: %v", err)
	}
	s.stop()
	f.wg.Wait() // every receiving goroutine ended
	if s.C() != nil || s.Retry() != nil {
		t.Fatal("stop left a channel")
	}
}

// TestSubscriptionENOBUFS: the kernel really ends an address subscription
// whose socket overflows (ENOBUFS), and the renewed one delivers again. In a
// scratch network namespace, on this test's thread (discarded at the end).
func TestSubscriptionENOBUFS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates a network namespace)")
	}
	runtime.LockOSThread()
	if _, err := netns.New(); err != nil {
		t.Fatal(err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil || netlink.LinkSetUp(lo) != nil {
		t.Fatal("lo:", err)
	}
	small := func(ch chan netlink.AddrUpdate, done chan struct{}) error {
		return netlink.AddrSubscribeWithOptions(ch, done, netlink.AddrSubscribeOptions{ReceiveBufferSize: 1, ReceiveBufferForceSize: true})
	}
	s := newSubscription("address", 0, small)
	if err := s.start(time.Now()); err != nil {
		t.Fatal(err)
	}
	defer s.stop()
	// Not reading while 512 addresses come: the socket overflows. The
	// library's goroutine blocks on the full channel (64); what it reads
	// next is the error.
	for i := range 512 {
		addr, _ := netlink.ParseAddr(fmt.Sprintf("198.18.%d.%d/32", 100+i/250, 1+i%250))
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.After(10 * time.Second)
	n := 0
closed:
	for {
		select {
		case _, ok := <-s.C():
			if !ok {
				break closed
			}
			n++
		case <-deadline:
			t.Fatalf("the subscription was not ended after %d updates of 512", n)
		}
	}
	if n >= 512 {
		t.Fatalf("all %d updates arrived: no overflow to test", n)
	}
	if err := s.lost(time.Now()); err != nil || s.C() == nil {
		t.Fatalf("renewal: %v", err)
	}
	addr, _ := netlink.ParseAddr("198.18.110.1/32")
	if err := netlink.AddrAdd(lo, addr); err != nil {
		t.Fatal(err)
	}
	select {
	case u, ok := <-s.C():
		if !ok || !u.LinkAddress.IP.Equal(net.ParseIP("198.18.110.1")) {
			t.Fatalf("after renewal: %+v %v", u, ok)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the renewed subscription delivers nothing")
	}
	t.Logf("%d of 512 updates before ENOBUFS ended the subscription", n)
}
