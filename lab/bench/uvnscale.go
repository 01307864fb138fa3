package bench

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn"
)

// UVNScaleResult is what `palisade-lab bench uvnsetup` reports from a node.
type UVNScaleResult struct {
	Users      int       `json:"users"`
	SetupMS    []float64 `json:"setup_ms"`    // i-th: with i users already set up
	TeardownMS []float64 `json:"teardown_ms"` // i-th: with users-i users left
	Leftovers  []string  `json:"leftovers"`   // uvn objects left after the last teardown
	// Reached is how many users were set up; Failed why the next failed.
	Reached int    `json:"reached"`
	Failed  string `json:"failed,omitempty"`
}

// UVNScale sets up n users (uids first..first+n-1, no passwd entry needed)
// one after another on this node, timing each setup as the node fills up,
// then tears them all down, timing each, and lists what is left. It calls
// the uvn manager in-process, as `palisade uvn setup` does after parsing
// its flags, so process start-up (slow under the VM's emulation) is not
// counted. Users already set up before are torn down first.
func UVNScale(configPath string, first uint32, n int) (*UVNScaleResult, error) {
	cfg, err := config.Load(configPath)
	if err != nil {
		return nil, err
	}
	if !cfg.UVN.Enable || len(cfg.UVN.Underlays) == 0 {
		return nil, fmt.Errorf("%s: uvn is not enabled on this node", configPath)
	}
	var nodes []netip.Addr
	for _, nd := range cfg.Nodes {
		nodes = append(nodes, nd.Addr)
	}
	m := uvn.New(&cfg.UVN, nodes)
	res := &UVNScaleResult{Users: n}
	var done []uint32
	// Whatever happens, leave no user of ours behind.
	defer func() {
		for _, u := range done {
			_ = m.Teardown(u)
		}
	}()
	for i := 0; i < n; i++ {
		uid := first + uint32(i)
		t0 := time.Now()
		if _, err := m.Setup(uid, 0, 0); err != nil {
			// Where it stops is the result: tear down and report it.
			res.Failed = fmt.Sprintf("setup of user %d (uid %d, %d users present) failed: %v", i+1, uid, i, err)
			break
		}
		res.SetupMS = append(res.SetupMS, float64(time.Since(t0).Microseconds())/1e3)
		done = append(done, uid)
		res.Reached = len(done)
	}
	for len(done) > 0 {
		uid := done[len(done)-1]
		t0 := time.Now()
		if err := m.Teardown(uid); err != nil {
			return nil, fmt.Errorf("teardown uid %d: %w", uid, err)
		}
		res.TeardownMS = append(res.TeardownMS, float64(time.Since(t0).Microseconds())/1e3)
		done = done[:len(done)-1]
	}
	left, err := uvn.Leftovers()
	if err != nil {
		return nil, err
	}
	// Other users (the bench's own, in its mode rounds) may hold their
	// networks and the node-wide objects: count only ours.
	ours := map[string]bool{}
	for i := 0; i < n; i++ {
		uid := first + uint32(i)
		ours["link "+uvn.VRFName(uid)] = true
		for u := range cfg.UVN.Underlays {
			ours["link "+uvn.VXLANName(u, uid)] = true
		}
	}
	res.Leftovers = []string{}
	for _, l := range left {
		var table uint32
		_, serr := fmt.Sscanf(l, "route table %d", &table)
		if ours[l] || (serr == nil && table >= first && table < first+uint32(n)) {
			res.Leftovers = append(res.Leftovers, l)
		}
	}
	return res, nil
}
