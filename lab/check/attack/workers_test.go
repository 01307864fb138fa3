package attack

import (
	"bufio"
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"
)

// TestServeActs: `probe act --serve` runs a step per spec line and answers
// each with its result line, in order; a bad line and a step that would
// keep other ids get an error result, and the loop goes on.
func TestServeActs(t *testing.T) {
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	spec := func(nonce string) string {
		b, _ := json.Marshal(ActSpec{Sock: Sock{Proto: "udp", Family: 4}, Dst: pc.LocalAddr().String(), Nonce: nonce})
		return string(b)
	}
	creds, _ := json.Marshal(ActSpec{Sock: Sock{Proto: "udp", Family: 4}, Dst: pc.LocalAddr().String(), Nonce: "c", Creds: &Creds{}})
	in := strings.Join([]string{spec("n1"), "{not json", string(creds), spec("n2")}, "\n") + "\n"
	var out strings.Builder
	if err := ServeActs(strings.NewReader(in), &out); err != nil {
		t.Fatal(err)
	}
	var res []ActResult
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	for sc.Scan() {
		var r ActResult
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("result line %q: %v", sc.Text(), err)
		}
		res = append(res, r)
	}
	if len(res) != 4 {
		t.Fatalf("%d result lines, want 4:\n%s", len(res), out.String())
	}
	if !res[0].OK || !res[3].OK {
		t.Errorf("the two good steps: %+v, %+v", res[0], res[3])
	}
	if res[1].OK || !strings.Contains(res[1].Error, "bad spec") {
		t.Errorf("bad line: %+v", res[1])
	}
	if res[2].OK || !strings.Contains(res[2].Error, "not served") {
		t.Errorf("a step with Creds: %+v", res[2])
	}
	// Both datagrams arrived, each with its nonce.
	got := map[string]bool{}
	b := make([]byte, 2048)
	for range 2 {
		pc.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, _, err := pc.ReadFrom(b)
		if err != nil {
			t.Fatal(err)
		}
		for _, nc := range []string{"n1", "n2"} {
			if strings.Contains(string(b[:n]), string(Payload(nc))) {
				got[nc] = true
			}
		}
	}
	if !got["n1"] || !got["n2"] {
		t.Errorf("datagrams: %v, want n1 and n2", got)
	}
}
