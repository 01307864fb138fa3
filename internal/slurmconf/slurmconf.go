// Package slurmconf reads the few slurm.conf settings Palisade needs: the
// accounts Slurm's daemons run as (they must never be locked out of the
// default VRF) and SrunPortRange (the ports srun and salloc listen on for
// Slurm's callbacks).
package slurmconf

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// DefaultPath is where Slurm looks when SLURM_CONF is unset.
const DefaultPath = "/etc/slurm/slurm.conf"

// Conf holds the settings read from slurm.conf.
type Conf struct {
	// SlurmUser runs slurmctld (Slurm's default: root).
	SlurmUser string
	// SlurmdUser runs slurmd and slurmstepd (default root).
	SlurmdUser string
	// SrunPortRange is "first-last", or "" when unset (srun then listens on
	// ephemeral ports).
	SrunPortRange string
	// SrunFirst and SrunLast are SrunPortRange parsed (0 when unset).
	SrunFirst, SrunLast uint16
}

// Read parses path. Keys are case-insensitive, as in Slurm; the last
// occurrence wins; Include lines are not followed (Palisade's keys belong in
// the main file).
func Read(path string) (*Conf, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	c := &Conf{SlurmUser: "root", SlurmdUser: "root"}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	line := 0
	for sc.Scan() {
		line++
		s := sc.Text()
		if i := strings.IndexByte(s, '#'); i >= 0 {
			s = s[:i]
		}
		// A line may hold several Key=Value pairs (NodeName=… CPUs=…); the
		// keys read here stand alone, first on their line.
		k, v, ok := strings.Cut(strings.TrimSpace(s), "=")
		if !ok {
			continue
		}
		if f := strings.Fields(v); len(f) > 0 {
			v = f[0]
		} else {
			v = ""
		}
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "slurmuser":
			c.SlurmUser = v
		case "slurmduser":
			c.SlurmdUser = v
		case "srunportrange":
			first, last, err := parseRange(v)
			if err != nil {
				return nil, fmt.Errorf("%s:%d: SrunPortRange: %w", path, line, err)
			}
			c.SrunPortRange, c.SrunFirst, c.SrunLast = v, first, last
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

func parseRange(v string) (uint16, uint16, error) {
	a, b, ok := strings.Cut(v, "-")
	if !ok {
		return 0, 0, fmt.Errorf("%q: want first-last", v)
	}
	first, err1 := strconv.ParseUint(strings.TrimSpace(a), 10, 16)
	last, err2 := strconv.ParseUint(strings.TrimSpace(b), 10, 16)
	if err1 != nil || err2 != nil || first == 0 || last < first {
		return 0, 0, fmt.Errorf("%q: want first-last with 0 < first <= last <= 65535", v)
	}
	return uint16(first), uint16(last), nil
}

// Accounts are the daemon accounts (SlurmUser, SlurmdUser), without
// duplicates.
func (c *Conf) Accounts() []string {
	if c.SlurmdUser == c.SlurmUser {
		return []string{c.SlurmUser}
	}
	return []string{c.SlurmUser, c.SlurmdUser}
}
