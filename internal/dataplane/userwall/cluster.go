package userwall

import (
	"encoding/json"
	"os"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
)

// report is the agent's answer to status queries (ident service). It runs
// on the ident service's goroutines: it reads only the pins, the state
// file and the configuration file, as `palisade status` does.
func (a *agent) report() (json.RawMessage, error) {
	s, err := control.GetStatus(a.opts, false)
	if err != nil {
		return nil, err
	}
	host, _ := os.Hostname()
	r := control.NodeReport{Host: host, Mode: s.Mode, Enforcing: s.Enabled && !s.Audit, Audit: s.Audit,
		Links: len(s.Links), Warnings: s.Warnings, Errors: s.Errors}
	if st := s.Agent; st != nil {
		r.Version, r.Commit, r.ConfigSHA, r.SharedSHA = st.Version, st.Commit, st.ConfigSHA, st.SharedSHA
		r.Generation, r.Started, r.LastReload, r.LastReloadError = st.Generation, st.Started, st.LastReload, st.LastReloadError
	}
	return json.Marshal(r)
}
