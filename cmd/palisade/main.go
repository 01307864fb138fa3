// Command palisade is Palisade's single binary: agent, operator CLI, testbed,
// isolation matrix and benchmarks. Everything lives in packages; this file
// only hands control to the command tree.
package main

import (
	"os"

	"github.com/palisade-hpc/palisade/cli"
)

func main() {
	os.Exit(cli.Execute())
}
