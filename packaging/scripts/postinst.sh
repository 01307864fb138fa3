#!/bin/sh
# Palisade package: after install or upgrade (deb: "configure OLD-VERSION",
# OLD-VERSION empty on a first install; rpm: $1 = 1 install, >= 2 upgrade).
#
# A first install enables and starts nothing: the default configuration
# trusts no cluster subnet, which on a cluster node would refuse users'
# cross-node traffic. Configure /etc/palisade/palisade.toml, check it with
# `palisade config check`, then `systemctl enable --now palisade-agent`
# (see /usr/share/doc/palisade/deploy.md).
set -e
upgrade=
case "$1" in
configure) [ -n "$2" ] && upgrade=1 ;;
[2-9] | [1-9][0-9]*) upgrade=1 ;;
esac
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload >/dev/null 2>&1 || true
	if [ -n "$upgrade" ]; then
		# A running agent is replaced by the new one, which adopts the
		# pinned programs and maps: the node keeps enforcing throughout.
		# The new version must accept the configuration and pass its
		# policy tests ([[test]]), or the running agent and its policy stay.
		agent=palisade-agent.service
		if [ -f /etc/palisade/palisade.toml ] && ! out=$(palisade policy test /etc/palisade/palisade.toml 2>&1); then
			echo "palisade: /etc/palisade/palisade.toml is refused by this version (invalid, or its policy tests fail);" >&2
			echo "palisade: palisade-agent NOT restarted: the running agent keeps enforcing its policy. Fix it, then:" >&2
			echo "palisade:   palisade policy test && systemctl restart palisade-agent" >&2
			printf '%s\n' "$out" | grep -v '^PASS' | tail -n 20 >&2
			agent=
		fi
		systemctl try-restart $agent palisade-ident.service palisade-gateway.service >/dev/null 2>&1 || true
	fi
fi
exit 0
