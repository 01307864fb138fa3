//go:build palisade_fault_injection

package uvn

import "os"

// A build for the rollback tests (go build -tags palisade_fault_injection):
// PALISADE_UVN_FAIL_AT=<step> fails that step of a setup.
func init() {
	faultInjection = true
	failAtEnv = func() string { return os.Getenv("PALISADE_UVN_FAIL_AT") }
}
