package egress

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestBenchEgress prints reference 002's Table 1 for this machine: Mbit/s
// with 1, 2, 10 and 20 parallel transfers per path, and the gateway's RSS
// with 100 clients. Opt-in (speed lives in benchmarks, not tests):
// PALISADE_EGRESS_BENCH=1 (seconds per run: PALISADE_EGRESS_BENCH_SECS).
func TestBenchEgress(t *testing.T) {
	if os.Getenv("PALISADE_EGRESS_BENCH") == "" {
		t.Skip("set PALISADE_EGRESS_BENCH=1")
	}
	needTestbed(t)
	secs, _ := strconv.Atoi(os.Getenv("PALISADE_EGRESS_BENCH_SECS"))
	if secs == 0 {
		secs = 5
	}
	paths := BenchPaths
	if p := os.Getenv("PALISADE_EGRESS_BENCH_PATHS"); p != "" {
		paths = strings.Split(p, ",")
	}
	ctx := context.Background()
	if r := os.Getenv("PALISADE_EGRESS_BENCH_RATE"); r != "" {
		if err := env.ShapeLinks(ctx, r); err != nil {
			t.Fatal(err)
		}
		defer env.ShapeLinks(ctx, "")
		fmt.Printf("gateway -> outside link shaped to %s\n", r)
	}
	fmt.Printf("%-12s %8s %8s %8s %8s   (Mbit/s; ratio to direct)\n", "path", "1", "2", "10", "20")
	direct := map[int]float64{}
	for _, p := range paths {
		line := fmt.Sprintf("%-12s", p)
		for _, n := range []int{1, 2, 10, 20} {
			v, err := env.Throughput(ctx, tb, p, n, time.Duration(secs)*time.Second)
			if err != nil {
				t.Errorf("%s x%d: %v", p, n, err)
				line += fmt.Sprintf(" %8s", "err")
				continue
			}
			if p == "direct" {
				direct[n] = v
				line += fmt.Sprintf(" %8.0f", v)
			} else if direct[n] > 0 {
				line += fmt.Sprintf(" %4.0f/%.2f", v, v/direct[n])
			} else {
				line += fmt.Sprintf(" %8.0f", v)
			}
		}
		fmt.Println(line)
	}
	if os.Getenv("PALISADE_EGRESS_BENCH_RSS") != "" {
		n, _ := strconv.Atoi(os.Getenv("PALISADE_EGRESS_BENCH_RSS"))
		for _, unpriv := range []bool{false, true} {
			r, err := env.GatewayRSS(ctx, tb, n, unpriv)
			if err != nil {
				t.Errorf("rss: %v", err)
				continue
			}
			fmt.Printf("gateway (unprivileged=%v) RSS with %d clients: %.1f MB\n", unpriv, n, float64(r)/1e6)
		}
	}
}
