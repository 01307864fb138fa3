package policy

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxHostlist bounds what one hostlist expression may expand to.
const MaxHostlist = 65536

// ExpandHostlist expands a Slurm hostlist expression ("node[01-04,7],login1",
// "r[1-2]n[1-3]") into host names, in order, without duplicates. Ranges keep
// the zero padding of their first number, as Slurm's do.
func ExpandHostlist(expr string) ([]string, error) {
	var items []string
	depth, start := 0, 0
	for i, ch := range expr {
		switch ch {
		case '[':
			if depth++; depth > 1 {
				return nil, fmt.Errorf("bad hostlist %q: nested '['", expr)
			}
		case ']':
			if depth--; depth < 0 {
				return nil, fmt.Errorf("bad hostlist %q: ']' without '['", expr)
			}
		case ',':
			if depth == 0 {
				items = append(items, expr[start:i])
				start = i + 1
			}
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("bad hostlist %q: '[' not closed", expr)
	}
	items = append(items, expr[start:])
	var out []string
	seen := map[string]bool{}
	for _, it := range items {
		it = strings.TrimSpace(it)
		if it == "" {
			return nil, fmt.Errorf("bad hostlist %q: empty name", expr)
		}
		names, err := expandOne(it, MaxHostlist-len(out))
		if err != nil {
			return nil, fmt.Errorf("bad hostlist %q: %w", expr, err)
		}
		for _, n := range names {
			if !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	return out, nil
}

// expandOne expands one name with bracketed ranges, at most limit names.
func expandOne(s string, limit int) ([]string, error) {
	i := strings.IndexByte(s, '[')
	if i < 0 {
		if !validHostChars(s) {
			return nil, fmt.Errorf("%q is not a host name", s)
		}
		return []string{s}, nil
	}
	j := strings.IndexByte(s, ']')
	prefix, body, rest := s[:i], s[i+1:j], s[j+1:]
	if !validHostChars(prefix) {
		return nil, fmt.Errorf("%q is not a host name", prefix)
	}
	var nums []string
	for _, r := range strings.Split(body, ",") {
		a, b, isRange := strings.Cut(strings.TrimSpace(r), "-")
		lo, err := hostNum(a)
		if err != nil {
			return nil, err
		}
		hi := lo
		if isRange {
			if hi, err = hostNum(b); err != nil {
				return nil, err
			}
			if hi < lo {
				return nil, fmt.Errorf("inverted range [%s]", r)
			}
		}
		if hi-lo >= uint64(limit) || len(nums)+int(hi-lo+1) > limit {
			return nil, fmt.Errorf("expands to more than %d names", MaxHostlist)
		}
		for n := lo; n <= hi; n++ {
			v := strconv.FormatUint(n, 10)
			if len(v) < len(a) {
				v = strings.Repeat("0", len(a)-len(v)) + v
			}
			nums = append(nums, v)
		}
	}
	tails := []string{""}
	if rest != "" {
		var err error
		if tails, err = expandOne(rest, limit); err != nil {
			return nil, err
		}
	}
	if len(nums)*len(tails) > limit {
		return nil, fmt.Errorf("expands to more than %d names", MaxHostlist)
	}
	var out []string
	for _, n := range nums {
		for _, t := range tails {
			out = append(out, prefix+n+t)
		}
	}
	return out, nil
}

func hostNum(s string) (uint64, error) {
	if s == "" || len(s) > 9 {
		return 0, fmt.Errorf("bad number %q in a range", s)
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("bad number %q in a range", s)
	}
	return n, nil
}

func validHostChars(s string) bool {
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}
