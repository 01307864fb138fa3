package kernel

import (
	"maps"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"

	"github.com/palisade-hpc/palisade/internal/policy"
)

func TestLPMKey(t *testing.T) {
	k := lpmKey(netip.MustParsePrefix("198.18.0.0/24"))
	if k.Prefixlen != 120 || k.Addr[10] != 0xff || k.Addr[11] != 0xff || k.Addr[12] != 198 || k.Addr[13] != 18 {
		t.Errorf("v4 key %+v", k)
	}
	k = lpmKey(netip.MustParsePrefix("2001:2::/64"))
	if k.Prefixlen != 64 || k.Addr[0] != 0x20 || k.Addr[1] != 0x01 || k.Addr[3] != 0x02 {
		t.Errorf("v6 key %+v", k)
	}
}

// TestEnumsMatchC holds the Go side to the C enums uw_rule, uw_path and
// uw_stamp: the enums of bpf/userwall.c must be the ones in the embedded
// object's BTF (the generated files are not stale), every C enumerator must
// have its Go name (derived from the C name, so a renumbered or added
// enumerator cannot silently take another's name), every policy rule must
// be a C rule, and RuleAllows must be the C's allows().
func TestEnumsMatchC(t *testing.T) {
	src, err := os.ReadFile("../bpf/userwall.c")
	if err != nil {
		t.Fatal(err)
	}
	inC := cEnums(t, string(src))
	spec, err := loadUwbpf()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]func(uint64) (string, bool){
		"uw_rule":  func(v uint64) (string, bool) { n, ok := ruleNames[uwbpfUwRule(v)]; return n, ok },
		"uw_path":  func(v uint64) (string, bool) { n, ok := pathNames[uwbpfUwPath(v)]; return n, ok },
		"uw_stamp": func(v uint64) (string, bool) { n, ok := stampNames[uwbpfUwStamp(v)]; return n, ok },
	}
	goLen := map[string]int{"uw_rule": len(ruleNames), "uw_path": len(pathNames), "uw_stamp": len(stampNames)}
	// Where the Go name is not the C name in lower case with dashes.
	alias := map[string]string{"R_DENIED": string(policy.RuleDenied), "R_COBIND": "co-bind",
		"R_OFFCLUSTER_PORT": string(policy.RuleOffClusterPort), "R_OFFCLUSTER_DENIED": string(policy.RuleOffClusterDenied)}
	// Enumerators that are not values of events or counters.
	unnamed := map[string]bool{"R_NONE": true, "R_MAX": true, "P_MAX": true}
	ruleValue := map[string]uint64{}
	for enum, goName := range names {
		typ, err := spec.Types.AnyTypeByName(enum)
		if err != nil {
			t.Fatalf("%s not in the object's BTF (bpf2go -type): %v", enum, err)
		}
		e, ok := typ.(*btf.Enum)
		if !ok {
			t.Fatalf("%s is a %T", enum, typ)
		}
		inBTF := map[string]uint64{}
		for _, v := range e.Values {
			inBTF[v.Name] = v.Value
		}
		if !maps.Equal(inBTF, inC[enum]) {
			t.Errorf("enum %s: bpf/userwall.c has %v, the embedded object %v: run go generate", enum, inC[enum], inBTF)
		}
		named := 0
		for c, v := range inBTF {
			if enum == "uw_rule" {
				ruleValue[c] = v
			}
			n, ok := goName(v)
			if unnamed[c] {
				if ok {
					t.Errorf("%s %s = %d has a Go name %q", enum, c, v, n)
				}
				continue
			}
			want := alias[c]
			if want == "" {
				want = strings.ReplaceAll(strings.ToLower(c[2:]), "_", "-")
			}
			if n != want {
				t.Errorf("%s %s = %d is named %q in Go, want %q", enum, c, v, n, want)
			}
			named++
		}
		if goLen[enum] != named {
			t.Errorf("%s: Go names %d values, the C enum %d", enum, goLen[enum], named)
		}
	}
	if uint64(numRules) != ruleValue["R_MAX"] {
		t.Errorf("numRules %d, R_MAX %d", numRules, ruleValue["R_MAX"])
	}
	for _, r := range []policy.Rule{policy.RuleSameUser, policy.RuleSharedGroup, policy.RuleSystemPort,
		policy.RuleExemptConnector, policy.RuleExemptListener, policy.RuleOffClusterPort,
		policy.RuleOffClusterDenied, policy.RuleDenied} {
		found := false
		for _, n := range ruleNames {
			found = found || n == string(r)
		}
		if !found {
			t.Errorf("policy rule %s has no C rule", r)
		}
	}
	// allows() in the C: "rule != R_X && ..." lists the refusing rules.
	body := regexp.MustCompile(`(?s)int allows\(__u32 rule\)\s*\{(.*?)\}`).FindStringSubmatch(string(src))
	if body == nil {
		t.Fatal("allows() not found in bpf/userwall.c")
	}
	refuses := map[string]bool{}
	for _, m := range regexp.MustCompile(`rule != (R_\w+)`).FindAllStringSubmatch(body[1], -1) {
		refuses[m[1]] = true
	}
	if len(refuses) == 0 {
		t.Fatalf("allows() not understood: %s", body[1])
	}
	for c, v := range ruleValue {
		if unnamed[c] {
			continue
		}
		if RuleAllows(uint8(v)) == refuses[c] {
			t.Errorf("RuleAllows(%s) = %v, allows() in the C refuses: %v", c, RuleAllows(uint8(v)), refuses[c])
		}
	}
}

// cEnums parses the "enum uw_x { NAME = value, ... };" blocks of the C.
func cEnums(t *testing.T, src string) map[string]map[string]uint64 {
	out := map[string]map[string]uint64{}
	for _, m := range regexp.MustCompile(`(?s)\benum (uw_\w+) \{(.*?)\};`).FindAllStringSubmatch(src, -1) {
		vals := map[string]uint64{}
		next := uint64(0)
		for _, line := range strings.Split(m[2], ",") {
			line = strings.TrimSpace(regexp.MustCompile(`(?s)/\*.*?\*/`).ReplaceAllString(line, ""))
			if line == "" {
				continue
			}
			name, val, ok := strings.Cut(line, "=")
			if ok {
				v, err := strconv.ParseUint(strings.TrimSpace(val), 0, 64)
				if err != nil {
					t.Fatalf("enum %s: %q: %v", m[1], line, err)
				}
				next = v
			}
			vals[strings.TrimSpace(name)] = next
			next++
		}
		out[m[1]] = vals
	}
	for _, e := range []string{"uw_rule", "uw_path", "uw_stamp"} {
		if len(out[e]) == 0 {
			t.Fatalf("enum %s not found in bpf/userwall.c", e)
		}
	}
	return out
}
