package policy

// AgentConfig is the [agent] table: settings of `palisade agent` (the
// userwall data plane). Owned by the userwall engineer, who adds its keys,
// their defaults (SetDefaults) and their validation (Validate).
type AgentConfig struct{}

// SetDefaults fills in defaults before the file's values are decoded.
func (a *AgentConfig) SetDefaults() {}

// Validate checks the table after decoding. Return a *KeyError (KeyErrorf)
// per bad key, joined with errors.Join, so the loader can name file and line.
func (a *AgentConfig) Validate() error { return nil }
