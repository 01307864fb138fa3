// Package control is how the CLI (and other nodes) see and steer a node's
// userwall without being its agent: status from the pins and the agent's
// state file (GetStatus), uninstall (Uninstall), reload and log-reopen
// signals with their acknowledgements (SignalReload, SignalReopen), the
// cluster view over the ident service (ClusterView), and the agent's
// options, pid file and state file (Options, ReadPid, AgentState). The
// agent (package userwall) writes the state file and answers the status
// queries with the types here; this package never imports the agent.
package control
