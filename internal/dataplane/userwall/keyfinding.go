package userwall

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

// KeyFinding checks the cluster key as the agent loads it: without a usable
// key no identity from another node is trusted, so every user's cross-node
// traffic is refused — an ERROR of config check, refused by a reload.
// (Skipped when the caller may not read it.)
func KeyFinding(cfg *config.Config) (config.Finding, bool) {
	if len(cfg.Policy.ClusterSubnets) == 0 {
		return config.Finding{}, false
	}
	path := cmp.Or(cfg.Cluster.KeyFile, config.DefaultKeyFile)
	_, err := kernel.LoadKeys(path)
	if err == nil || errors.Is(err, fs.ErrPermission) {
		return config.Finding{}, false
	}
	return config.Finding{Severity: config.Problem, Level: config.Problem.String(), Key: "cluster.key_file", Line: cfg.KeyLine("cluster.key_file"),
		Msg: fmt.Sprintf("%v: identity from other nodes is not trusted, users' cross-node traffic is refused "+
			"(make one: (umask 077; openssl rand -hex 16 > %s), the same on every node)", err, path)}, true
}
