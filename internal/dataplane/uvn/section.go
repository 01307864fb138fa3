package uvn

import (
	"github.com/palisade-hpc/palisade/internal/dataplane/uvn/uvnconfig"
	"github.com/palisade-hpc/palisade/internal/policy"
)

// The [uvn] section's types live in uvnconfig: the configuration imports
// them, never this data plane.
type (
	Config   = uvnconfig.Config
	Underlay = uvnconfig.Underlay
)

const (
	MaxUnderlays = uvnconfig.MaxUnderlays
	VNIBits      = uvnconfig.VNIBits
	maxSrunPorts = uvnconfig.MaxSrunPorts
)

// SiteNote is uvnconfig.SiteNote.
type SiteNote = uvnconfig.SiteNote

// SiteNotes is uvnconfig.SiteNotes: the site rules uvn cannot enforce as
// written.
func SiteNotes(p *policy.Policy, minUID int64, srun policy.PortRange, callers []uint32) []SiteNote {
	return uvnconfig.SiteNotes(p, minUID, srun, callers)
}

// CheckSrunRange is uvnconfig.CheckSrunRange.
func CheckSrunRange(srun policy.PortRange, underlay []policy.PortRange) error {
	return uvnconfig.CheckSrunRange(srun, underlay)
}

// The section checks the session programs' limits when the file is
// loaded; they are the generated ones or this does not compile (a
// negative constant has no uint).
const (
	_ uint = uint(uvnconfig.MaxPortRanges - int(vrfbpfUvnLimitUVN_MAX_PORT_RANGES))
	_ uint = uint(int(vrfbpfUvnLimitUVN_MAX_PORT_RANGES) - uvnconfig.MaxPortRanges)
	_ uint = uint(uvnconfig.MaxNets4 - int(vrfbpfUvnLimitUVN_MAX_NETS4))
	_ uint = uint(int(vrfbpfUvnLimitUVN_MAX_NETS4) - uvnconfig.MaxNets4)
)
