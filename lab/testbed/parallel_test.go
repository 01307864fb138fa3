package testbed

import (
	"errors"
	"sync/atomic"
	"testing"
)

func TestParallel(t *testing.T) {
	var ran atomic.Int32
	e2, e3 := errors.New("two"), errors.New("three")
	err := Parallel([]int{1, 2, 3}, func(i int) error {
		ran.Add(1)
		return map[int]error{2: e2, 3: e3}[i]
	})
	if ran.Load() != 3 || !errors.Is(err, e2) || !errors.Is(err, e3) {
		t.Errorf("ran %d, err %v: want all three run and both failures", ran.Load(), err)
	}
	if err := Parallel([]int{1}, func(int) error { return nil }); err != nil {
		t.Errorf("no failure: %v", err)
	}
}
