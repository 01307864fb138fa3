package config

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
)

// SharedSHA256 is the identity of the cluster-wide part of the
// configuration: the [policy], [cluster] and [offcluster] tables as
// decoded (formatting and comments aside). Every node must agree on it;
// [agent], [uvn] and [egress] hold paths and local settings that may
// differ per node. `palisade status --all` reports drift on it.
func (c *Config) SharedSHA256() string {
	b, _ := json.Marshal(struct {
		Rules      PolicyConfig
		Cluster    ClusterConfig
		OffCluster OffClusterConfig
	}{c.Rules, c.Cluster, c.OffCluster})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
