package policy

import (
	"fmt"
	"strconv"
	"strings"
)

// The configuration's building blocks that the sections of every data plane
// share (internal/config composes the sections; each plane owns its own).

// Principal is a user given as a name or a decimal uid, or "@group" for the
// members of a group (name or decimal gid); the config accepts a TOML
// string or integer and keeps it as text.
type Principal string

// UnmarshalTOML implements toml.Unmarshaler.
func (p *Principal) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case string:
		*p = Principal(v)
	case int64:
		*p = Principal(strconv.FormatInt(v, 10))
	default:
		return fmt.Errorf("want a user name or uid, got %s", tomlType(v))
	}
	return nil
}

// PortSpec is a port or an inclusive range "first-last", from a TOML string or
// integer, kept as text until validation.
type PortSpec string

// UnmarshalTOML implements toml.Unmarshaler.
func (p *PortSpec) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case string:
		*p = PortSpec(v)
	case int64:
		*p = PortSpec(strconv.FormatInt(v, 10))
	default:
		return fmt.Errorf("want a port or \"first-last\" range, got %s", tomlType(v))
	}
	return nil
}

func tomlType(v any) string {
	switch v.(type) {
	case string:
		return "a string"
	case int64:
		return "an integer"
	case float64:
		return "a float"
	case bool:
		return "a boolean"
	case []any:
		return "an array"
	case map[string]any, []map[string]any:
		return "a table"
	}
	return "a date/time"
}

// KeyError is what a section's Validate returns to blame one key; the loader
// turns it into a ConfigError with the file, the line and the full key.
// Key is relative to the section ("metrics_addr"); Value, when set, is the
// offending array element, used to find its line in a multi-line array.
type KeyError struct {
	Key   string
	Value string
	Err   error
}

func (e *KeyError) Error() string { return e.Key + ": " + e.Err.Error() }
func (e *KeyError) Unwrap() error { return e.Err }

// KeyErrorf builds a KeyError for key with a formatted message.
func KeyErrorf(key, format string, args ...any) error {
	return &KeyError{Key: key, Err: fmt.Errorf(format, args...)}
}

// ParsePortRange parses "8443" or "9000-9100" (ports 1-65535, first <= last).
func ParsePortRange(s string) (PortRange, error) {
	first, last, isRange := strings.Cut(strings.TrimSpace(s), "-")
	a, err := parsePort(first)
	if err != nil {
		return PortRange{}, err
	}
	b := a
	if isRange {
		if b, err = parsePort(last); err != nil {
			return PortRange{}, err
		}
		if b < a {
			return PortRange{}, fmt.Errorf("inverted range %q: first port above last", s)
		}
	}
	return PortRange{a, b}, nil
}

func parsePort(s string) (uint16, error) {
	s = strings.TrimSpace(s)
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("bad port %q: want a number or a first-last range", s)
	}
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %d out of range (1-65535)", n)
	}
	return uint16(n), nil
}
