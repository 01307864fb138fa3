package testbed

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// RunName is an instance name of this process's own: "pal", a two-character
// kind, then the pid in base 36 (five characters hold any pid, so no two live
// processes share a name). Tests name their testbeds with it so that any
// number of runs — two CI clones, a developer's run beside `make test` — bring
// up testbeds side by side without a lock.
func RunName(kind string) string {
	if len(kind) != 2 || !nameRE.MatchString("pal"+kind) {
		panic(fmt.Sprintf("testbed.RunName(%q): want two lowercase letters or digits", kind))
	}
	return fmt.Sprintf("pal%s%05s", kind, strconv.FormatInt(int64(os.Getpid()), 36))
}

// OwnerEnv names a test process that runs the CLI (`palisade-lab testbed
// up`) as the owner of the instances it brings up.
const OwnerEnv = "PALISADE_TESTBED_OWNER"

// owner is who Up records as the instance's owner: a test process (the
// instance is its scratch) or nobody (the CLI's instances live until `down`).
func owner() (pid int, start uint64) {
	pid = os.Getpid()
	if v, err := strconv.Atoi(os.Getenv(OwnerEnv)); err == nil {
		pid = v
	} else if !testing.Testing() {
		return 0, 0
	}
	st, ok := procfs.Read(pid)
	if !ok {
		return 0, 0
	}
	return st.PID, st.Start
}

// DownOrphans takes down the instances whose owning test process is gone
// (killed or timed out before its cleanup ran), leaving every other
// instance alone: those of live tests, and all those the CLI brought up.
// Only instances whose mode this binary registers are taken down (another
// mode's Down hook would not run).
func DownOrphans(ctx context.Context) {
	ents, _ := os.ReadDir(BaseDir)
	for _, e := range ents {
		if !e.IsDir() || validateName(e.Name()) != nil {
			continue
		}
		s, err := readState(e.Name())
		if err != nil || s.Owner == 0 {
			continue
		}
		if st, ok := procfs.Read(s.Owner); ok && st.Start == s.OwnerStart {
			continue
		}
		if s.VM && getVM() == nil {
			continue
		}
		if _, ok := lookupMode(build(s).Mode); !ok && !s.VM {
			continue
		}
		if err := Down(ctx, s.Name); err != nil {
			fmt.Fprintf(os.Stderr, "testbed %s (its test process %d is gone): down: %v\n", s.Name, s.Owner, err)
		}
	}
}
