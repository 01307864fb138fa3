package config

import (
	"regexp"
	"strconv"
	"strings"
)

// locator finds the line of a key in TOML text. BurntSushi/toml records key
// positions but does not export them (only ParseError carries one), so the
// loader scans the text itself. It understands what a configuration file
// uses — [table] headers, key = value, dotted keys, multi-line arrays and
// strings — and falls back to the enclosing table's line (or none).
type locator struct {
	lines []string
	keys  map[string]int // full dotted key → 1-based line
	order []int          // lines that start a key, ascending
}

var (
	headerRe = regexp.MustCompile(`^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$`)
	keyRe    = regexp.MustCompile(`^\s*([A-Za-z0-9_\-]+(?:\s*\.\s*[A-Za-z0-9_\-]+)*|"[^"]*"|'[^']*')\s*=`)
)

func newLocator(data []byte) *locator {
	l := &locator{lines: strings.Split(string(data), "\n"), keys: map[string]int{}}
	table := ""
	inString := "" // open multi-line string delimiter
	for i, line := range l.lines {
		n := i + 1
		if inString != "" {
			if strings.Count(line, inString)%2 == 1 {
				inString = ""
			}
			continue
		}
		if m := headerRe.FindStringSubmatch(line); m != nil {
			table = normKey(m[1])
			l.add(table, n)
			continue
		}
		if m := keyRe.FindStringSubmatch(line); m != nil {
			key := normKey(m[1])
			if table != "" {
				key = table + "." + key
			}
			l.add(key, n)
			for _, d := range []string{`"""`, `'''`} {
				if strings.Count(line, d)%2 == 1 {
					inString = d
				}
			}
		}
	}
	return l
}

func (l *locator) add(key string, n int) {
	if _, dup := l.keys[key]; !dup {
		l.keys[key] = n
	}
	l.order = append(l.order, n)
}

func normKey(k string) string {
	parts := strings.Split(k, ".")
	for i, p := range parts {
		parts[i] = strings.Trim(strings.TrimSpace(p), `"'`)
	}
	return strings.Join(parts, ".")
}

// line returns the line of key (or of its nearest enclosing key), 0 if none.
// With value set it returns the line, within the key's value, where that
// array element is written, so multi-line arrays point at the bad element.
func (l *locator) line(key, value string) int {
	n := 0
	for k := key; k != ""; {
		if v, ok := l.keys[k]; ok {
			n = v
			break
		}
		i := strings.LastIndex(k, ".")
		if i < 0 {
			break
		}
		k = k[:i]
	}
	if n == 0 || value == "" || n > len(l.lines) {
		return n
	}
	end := len(l.lines)
	for _, o := range l.order {
		if o > n {
			end = o - 1
			break
		}
	}
	for _, lit := range []string{strconv.Quote(value), "'" + value + "'", value} {
		for i := n; i <= end; i++ {
			text := l.lines[i-1]
			if i == n {
				if j := strings.Index(text, "="); j >= 0 {
					text = text[j+1:]
				}
			}
			if c := strings.Index(text, "#"); c >= 0 && !strings.Contains(text[:c], `"`) {
				text = text[:c]
			}
			if strings.Contains(text, lit) {
				return i
			}
		}
	}
	return n
}
