package kernel

// The generated C types and values the agent decodes (bpf2go -type in
// gen.go): one name each outside this package, still the generated type.
type (
	// RawEvent is one record of the "events" ring buffer (struct uw_event).
	RawEvent = uwbpfUwEvent
	// Rule is the decision rule of a verdict (enum uw_rule).
	Rule = uwbpfUwRule
	// Path is the hook path that decided (enum uw_path).
	Path = uwbpfUwPath
)

const (
	RuleSiteDeny  = uwbpfUwRuleR_SITE_DENY
	RuleUserGrant = uwbpfUwRuleR_USER_GRANT
	PathBind      = uwbpfUwPathP_BIND
	PathSource    = uwbpfUwPathP_SOURCE
)
