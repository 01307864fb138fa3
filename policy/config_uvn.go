package policy

// UVNConfig is the [uvn] table: settings of the UVN data plane
// (VRF + VXLAN per-user networks). Owned by the uvn engineer, who adds its keys,
// their defaults (SetDefaults) and their validation (Validate).
type UVNConfig struct{}

// SetDefaults fills in defaults before the file's values are decoded.
func (u *UVNConfig) SetDefaults() {}

// Validate checks the table after decoding. Return a *KeyError (KeyErrorf)
// per bad key, joined with errors.Join, so the loader can name file and line.
func (u *UVNConfig) Validate() error { return nil }
