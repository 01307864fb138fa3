package sockowner

import (
	"encoding/json"
	"testing"
)

// FuzzDecodeQuery: the ident service reads queries from any host that can
// reach its port. Any bytes give a query or a bad-query/bad-version answer
// (never both, never neither); an owner query that decodes re-encodes to
// itself (what a node forwards for the Unix API is what it was asked).
func FuzzDecodeQuery(f *testing.F) {
	for _, s := range []string{
		`{"v":1,"id":7,"proto":"tcp","addr":"198.18.0.2:5000"}`,
		`{"v":1,"id":8,"proto":"udp","addr":"[2001:2::1]:53","peer":"[2001:2::2]:4000","node":"198.18.0.3"}`,
		`{"v":1,"id":9,"kind":"status"}`,
		`{"v":1,"id":10,"kind":"flows","args":{"n":5}}`,
		`{"v":2,"id":1}`,
		`{"v":1,"addr":"198.18.0.2:0"}`,
		`{"v":1,"addr":"[::ffff:198.18.0.1]:80"}`,
		`not json`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		pq, bad := decodeQuery(b)
		if bad != nil {
			if bad.Status != StatusBadQuery && bad.Status != StatusBadVersion {
				t.Fatalf("bad query answered %q", bad.Status)
			}
			if _, err := json.Marshal(bad); err != nil {
				t.Fatal(err)
			}
			return
		}
		if pq.Kind != "" {
			return
		}
		if !pq.Addr.IsValid() || pq.Addr.Port() == 0 {
			t.Fatalf("owner query accepted without a usable address: %+v", pq)
		}
		again, bad := decodeQuery(encodeQuery(pq))
		if bad != nil {
			t.Fatalf("re-encoded query refused: %s (%s)", bad.Error, encodeQuery(pq))
		}
		if again.ID != pq.ID || again.Proto != pq.Proto || again.Addr != pq.Addr || again.Peer != pq.Peer || again.Node != pq.Node {
			t.Fatalf("round trip: %+v != %+v", again, pq)
		}
	})
}

// FuzzDecodeAnswer: a client reads answers from the network.
func FuzzDecodeAnswer(f *testing.F) {
	f.Add([]byte(`{"v":1,"id":7,"status":"ok","owner":{"uid":1000}}`), uint32(7))
	f.Add([]byte(`{"v":1,"id":7,"status":"ok"}`), uint32(7))
	f.Add([]byte(`{"v":1,"id":7,"status":"no-socket"}`), uint32(7))
	f.Add([]byte(`{"v":1,"id":6,"status":"ok","owner":{"uid":0}}`), uint32(7))
	f.Fuzz(func(t *testing.T, b []byte, id uint32) {
		var a Answer
		_, err := decodeAnswer(b, id)
		if err == nil && (json.Unmarshal(b, &a) != nil || a.ID != id || a.Status != StatusOK || a.Owner == nil) {
			t.Fatalf("accepted %s for query %d", b, id)
		}
	})
}
