package policy

// EgressConfig is the [egress] table: settings of the egress gateway,
// client, IPAM and DNS. Owned by the egress engineer, who adds its keys,
// their defaults (SetDefaults) and their validation (Validate).
type EgressConfig struct{}

// SetDefaults fills in defaults before the file's values are decoded.
func (e *EgressConfig) SetDefaults() {}

// Validate checks the table after decoding. Return a *KeyError (KeyErrorf)
// per bad key, joined with errors.Join, so the loader can name file and line.
func (e *EgressConfig) Validate() error { return nil }
