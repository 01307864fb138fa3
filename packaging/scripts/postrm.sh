#!/bin/sh
# Palisade .deb: after removal ("remove", "purge", "upgrade NEW-VERSION" ...).
#
# purge removes, beyond the conffiles, what running Palisade left on the
# node: the logs (/var/log/palisade, the uvn PAM log), the egress gateway's
# state (/var/lib/palisade) and the cluster key (a secret shared by every
# node must not outlive the package on a node that leaves the cluster).
# Files an administrator added to /etc/palisade (policy.d/) stay: dpkg then
# says the directory is not empty. (The .rpm's postun.sh: rpm has no purge.)
set -e
if [ "$1" = purge ]; then
	rm -rf /var/log/palisade /var/lib/palisade
	rm -f /var/log/palisade-uvn-pam.log /var/log/palisade-uvn-pam.log.*
	rm -f /etc/palisade/cluster.key
fi
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
