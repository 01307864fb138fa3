// Package h3 is the lab's HTTP/3 application (aioquic): one script, h3.py,
// for the apps bench's transfer (size mode) and the attack suite's
// legitimate-traffic case (nonce mode).
package h3

import (
	_ "embed"
	"os"
)

//go:embed h3.py
var script []byte

// Python is the Python with aioquic (.ci/deps installs it there).
const Python = "/opt/pal-quic/bin/python"

// Write writes the script to path (an instance's own directory: suites run
// side by side) for `Python path server|client ...`.
func Write(path string) error { return os.WriteFile(path, script, 0o644) }
