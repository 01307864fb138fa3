package userwall

import (
	"time"
)

// subscription is a netlink subscription (addresses, links) that is renewed
// when the kernel ends it. netlink closes the update channel when a receive
// fails, typically ENOBUFS after a burst of changes overflowed the socket:
// the updates in between are lost, so the owner resynchronises in full and
// the subscription is made again — at once, or after minGap since the last
// attempt, so that a subscription that keeps failing costs one attempt per
// minGap instead of a loop spinning on a closed channel.
//
// Only the agent's main loop uses a subscription (no lock).
type subscription[T any] struct {
	name      string
	subscribe func(ch chan T, done chan struct{}) error
	minGap    time.Duration

	ch      chan T        // nil while not subscribed: receives block
	done    chan struct{} // closing it ends netlink's goroutines
	last    time.Time     // of the last attempt
	retry   *time.Timer   // armed while a renewal waits
	retryC  <-chan time.Time
	renewed int // subscriptions made after the first (tests, logs)
}

func newSubscription[T any](name string, minGap time.Duration, subscribe func(ch chan T, done chan struct{}) error) *subscription[T] {
	return &subscription[T]{name: name, subscribe: subscribe, minGap: minGap}
}

func (s *subscription[T]) label() string { return s.name }

// C is the update channel (nil, never ready, while not subscribed).
func (s *subscription[T]) C() <-chan T { return s.ch }

// Retry is ready when a renewal is due (nil while none waits).
func (s *subscription[T]) Retry() <-chan time.Time { return s.retryC }

// start subscribes; on failure it schedules another attempt.
func (s *subscription[T]) start(now time.Time) error {
	s.last = now
	s.retryC = nil
	ch, done := make(chan T, 64), make(chan struct{})
	if err := s.subscribe(ch, done); err != nil {
		close(done)
		s.schedule(now)
		return err
	}
	s.ch, s.done = ch, done
	return nil
}

// lost is called when C was found closed: the old subscription is let go
// and a new one is made at once or scheduled. It returns start's error.
func (s *subscription[T]) lost(now time.Time) error {
	s.release()
	if now.Sub(s.last) < s.minGap {
		s.schedule(now)
		return nil
	}
	s.renewed++
	return s.start(now)
}

// due is called when Retry fired.
func (s *subscription[T]) due(now time.Time) error {
	s.renewed++
	return s.start(now)
}

func (s *subscription[T]) schedule(now time.Time) {
	wait := s.minGap - now.Sub(s.last)
	if wait < 0 {
		wait = 0
	}
	if s.retry == nil {
		s.retry = time.NewTimer(wait)
	} else {
		s.retry.Reset(wait)
	}
	s.retryC = s.retry.C
}

// release closes done and waits until netlink has closed ch (its receiving
// goroutine has ended), discarding what is still queued.
func (s *subscription[T]) release() {
	if s.ch == nil {
		return
	}
	close(s.done)
	for range s.ch {
	}
	s.ch, s.done = nil, nil
}

// stop ends the subscription and any pending renewal.
func (s *subscription[T]) stop() {
	s.release()
	if s.retry != nil {
		s.retry.Stop()
	}
	s.retryC = nil
}

// drain takes what is queued on a live channel (a burst is one resync);
// false if the channel turned out closed.
func drain[T any](ch <-chan T) bool {
	for len(ch) > 0 {
		if _, ok := <-ch; !ok {
			return false
		}
	}
	return true
}
