package directory

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
)

// TestDirectoryScale measures the membership tracker against a small and a
// large directory (on demand: PALISADE_DIRECTORY_SCALE=10000 go test -run
// TestDirectoryScale -v ./lab/directory; docs/benchmarks.md).
func TestDirectoryScale(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("PALISADE_DIRECTORY_SCALE"))
	if n <= 0 || os.Geteuid() != 0 {
		t.Skip("on demand: PALISADE_DIRECTORY_SCALE=<users> (root)")
	}
	held, _ := strconv.Atoi(os.Getenv("PALISADE_DIRECTORY_HELD"))
	if held <= 0 {
		held = 200
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	name := fmt.Sprintf("pals%05d", os.Getpid()%100000)
	small, err := Measure(ctx, name, 0, 1, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("small: %+v", *small)
	large, err := Measure(ctx, name, n, held, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("large: %+v", *large)
	fmt.Print(Table(small, large))
}
