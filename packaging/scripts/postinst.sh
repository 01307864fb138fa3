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
		systemctl try-restart palisade-agent.service palisade-ident.service palisade-gateway.service >/dev/null 2>&1 || true
	fi
fi
exit 0
