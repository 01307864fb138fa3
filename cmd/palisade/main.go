// Command palisade is Palisade's product binary: the node agent and the
// operator and user commands (status, explain, who, config, ident, uvn,
// gateway, egress). It contains no lab code: the testbed, the isolation
// matrix and the benchmarks are cmd/palisade-lab.
package main

import (
	"os"

	"github.com/palisade-hpc/palisade/internal/cli"
)

func main() {
	os.Exit(cli.Execute(cli.New()))
}
