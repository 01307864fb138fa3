// Package systemd holds the systemd units the packages install, embedded so
// that the lab runs its agents exactly as the shipped unit does (its
// capabilities and sandboxing): what the unit forbids fails in the testbed.
package systemd

import _ "embed"

// Agent is palisade-agent.service.
//
//go:embed palisade-agent.service
var Agent string
