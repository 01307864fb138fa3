package portal

import "github.com/palisade-hpc/palisade/internal/portal/portalconfig"

// Config is the [portal] section (package portalconfig: the configuration
// imports it, never the delegation).
type Config = portalconfig.Config
