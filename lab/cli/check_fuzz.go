package cli

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/cli"
	"github.com/palisade-hpc/palisade/lab/check/fuzz"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// runFuzz is `palisade-lab check --fuzz DURATION`: the attack fuzzer on
// the testbed, judged by mode's expectation; exits 1 on any finding not
// documented as known, or a positive control that reached nothing.
func runFuzz(ctx context.Context, tb *testbed.Testbed, d time.Duration, seed uint64, seedSet bool, mode, replay, nodes string, quiet bool) error {
	if !seedSet {
		var b [8]byte
		rand.Read(b[:])
		seed = binary.LittleEndian.Uint64(b[:]) >> 16 // short enough to type
	}
	opts := fuzz.Options{Duration: d, Seed: seed, Mode: mode}
	if nodes != "" {
		opts.Nodes = strings.Split(nodes, ",")
	}
	if replay != "" {
		data := []byte(replay)
		if !strings.HasPrefix(strings.TrimSpace(replay), "{") {
			b, err := os.ReadFile(replay)
			if err != nil {
				return err
			}
			data = b
		}
		var p fuzz.Program
		if err := json.Unmarshal(data, &p); err != nil {
			return fmt.Errorf("--fuzz-replay: %w", err)
		}
		opts.Replay = &p
	}
	if !quiet {
		opts.Log = func(f string, a ...any) { fmt.Fprintf(os.Stderr, f+"\n", a...) }
	}
	rep, err := fuzz.Run(ctx, tb, opts)
	if err != nil {
		return err
	}
	rep.Write(os.Stdout)
	if ctx.Err() != nil {
		return &cli.ExitError{Code: 130, Msg: "interrupted"}
	}
	if rep.Failed() {
		return &cli.ExitError{Code: 1, Msg: fmt.Sprintf("fuzz: seed %d failed", seed)}
	}
	return nil
}
