package userwall

import (
	"net/http"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/palisade-hpc/palisade/internal/version"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

var (
	descBuildInfo = prometheus.NewDesc("palisade_build_info",
		"Always 1; the labels say which build of Palisade the agent runs.",
		[]string{"version", "commit", "build_date", "goversion", "cilium_ebpf"}, nil)
	descConfigInfo = prometheus.NewDesc("palisade_config_info",
		"Always 1; the SHA-256 of the running configuration file (sha256sum of it): nodes running the same file show the same value.",
		[]string{"sha256", "path"}, nil)
	descConfigShared = prometheus.NewDesc("palisade_config_shared_info",
		"Always 1; the SHA-256 of the running configuration's cluster-wide tables ([policy], [cluster], [offcluster]): every node should show the same value (status --all's drift).",
		[]string{"shared_sha256"}, nil)
	descConfigGen = prometheus.NewDesc("palisade_config_generation",
		"Configurations applied since the agent started (1 = the one it started with).", nil, nil)
	descConfigReload = prometheus.NewDesc("palisade_config_last_reload_timestamp_seconds",
		"Time of the last reload (applied or refused); 0 if none since start.", nil, nil)
	descConfigReloadOK = prometheus.NewDesc("palisade_config_last_reload_success",
		"1 if the last reload was applied (or none happened), 0 if it was refused.", nil, nil)
	descAudit = prometheus.NewDesc("palisade_userwall_audit",
		"1 if the node is in audit mode (decides and logs, refuses nothing).", nil, nil)
	descFindings = prometheus.NewDesc("palisade_config_findings",
		"Findings of config check for the running configuration, by level (WARNING, ERROR).", []string{"level"}, nil)
	descKeyLoaded = prometheus.NewDesc("palisade_cluster_key_loaded",
		"1 if the configured cluster key is in force; 0: the node seals with a random key and trusts no identity from other nodes (users' cross-node traffic is refused).", nil, nil)
	descUnresolved = prometheus.NewDesc("palisade_config_unresolved_names",
		"Exempt names of the running configuration that NSS cannot resolve (not exempt until they do; retried at every group refresh).", nil, nil)
	descDecisions = prometheus.NewDesc("palisade_userwall_decisions_total",
		"Connection decisions taken in the kernel, by path and rule; verdict allow, deny, or audit (refused by the rules, let through by audit mode).", []string{"path", "rule", "verdict"}, nil)
	descLinks = prometheus.NewDesc("palisade_userwall_programs_attached",
		"eBPF program attachments (links) in force.", nil, nil)
	descLSM = prometheus.NewDesc("palisade_userwall_unix_enforced",
		"1 if abstract Unix sockets are enforced (BPF LSM), else 0.", nil, nil)
	descEntries = prometheus.NewDesc("palisade_userwall_map_entries",
		"Entries in the agent's eBPF maps.", []string{"map"}, nil)
	descEvents = prometheus.NewDesc("palisade_userwall_events_total",
		"Refusal events: logged, suppressed by the rate limit, write_error (the event log or syslog did not take it), lost (the ring buffer was full), malformed.", []string{"outcome"}, nil)
	descSamples = prometheus.NewDesc("palisade_userwall_allowed_samples_total",
		"Allowed verdicts reported for the flows (sampled), or only counted because the CPU's budget of flow_samples a second was spent (over_budget).", []string{"outcome"}, nil)
	descFlows = prometheus.NewDesc("palisade_userwall_flows_total",
		"Verdicts the agent's flow recorder kept (recorded) or could not keep up with (dropped).", []string{"outcome"}, nil)
	descFlowProcs = prometheus.NewDesc("palisade_userwall_flow_process_lookups_total",
		"Lookups of a flow end's process: named, or not (socket gone, lookup budget spent, node not answering).", []string{"outcome"}, nil)
	descTop = prometheus.NewDesc("palisade_userwall_refusals_top",
		"Refusals (verdict deny) and would-be refusals (audit) of the last hour, for the 10 largest (listener, port, connector, rule) groups only: a bounded label set.", []string{"listener", "port", "connector", "rule", "verdict"}, nil)
	descGrants = prometheus.NewDesc("palisade_user_grants_active",
		"User grants (palisade share) in force on this node: one per grantee of each shared port.", nil, nil)
	descWriteErrors = prometheus.NewDesc("palisade_agent_state_write_errors_total",
		"Agent state files not written (status, reload acknowledgements and monitoring read it).", nil, nil)
)

// topN bounds palisade_userwall_refusals_top.
const topN = 10

type collector struct{ a *agent }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descConfigInfo, descConfigShared, descConfigGen, descConfigReload, descConfigReloadOK, descAudit, descFindings, descKeyLoaded, descUnresolved, descBuildInfo, descDecisions, descLinks, descLSM, descEntries, descEvents, descSamples, descFlows, descFlowProcs, descTop, descGrants, descWriteErrors} {
		ch <- d
	}
}

func countEntries(m *ebpf.Map) float64 {
	var n float64
	it := m.Iterate()
	var k, v []byte
	for it.Next(&k, &v) {
		n++
	}
	return n
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	v := version.Get()
	ch <- prometheus.MustNewConstMetric(descBuildInfo, prometheus.GaugeValue, 1, v.Version, v.Commit, v.BuildDate, v.GoVersion, v.EBPF)
	st := c.a.stateSnapshot()
	ch <- prometheus.MustNewConstMetric(descConfigInfo, prometheus.GaugeValue, 1, st.ConfigSHA, st.Config)
	ch <- prometheus.MustNewConstMetric(descConfigShared, prometheus.GaugeValue, 1, st.SharedSHA)
	ch <- prometheus.MustNewConstMetric(descConfigGen, prometheus.GaugeValue, float64(st.Generation))
	last, ok := 0.0, 1.0
	if !st.LastReload.IsZero() {
		last = float64(st.LastReload.UnixNano()) / 1e9
	}
	if st.LastReloadError != "" {
		ok = 0
	}
	ch <- prometheus.MustNewConstMetric(descConfigReload, prometheus.GaugeValue, last)
	ch <- prometheus.MustNewConstMetric(descConfigReloadOK, prometheus.GaugeValue, ok)
	audit := 0.0
	if st.Audit {
		audit = 1
	}
	ch <- prometheus.MustNewConstMetric(descAudit, prometheus.GaugeValue, audit)
	n := map[string]float64{"WARNING": 0, "ERROR": 0}
	for _, f := range st.Findings {
		n[f.Level]++
	}
	for level, v := range n {
		ch <- prometheus.MustNewConstMetric(descFindings, prometheus.GaugeValue, v, level)
	}
	key := 0.0
	if st.KeyLoaded {
		key = 1
	}
	ch <- prometheus.MustNewConstMetric(descKeyLoaded, prometheus.GaugeValue, key)
	ch <- prometheus.MustNewConstMetric(descUnresolved, prometheus.GaugeValue, float64(st.Unresolved))
	d := c.a.dp
	if cs, err := d.ReadCounters(); err == nil {
		for _, x := range cs {
			ch <- prometheus.MustNewConstMetric(descDecisions, prometheus.CounterValue, float64(x.Count), x.Path, x.Rule, x.Verdict())
		}
	}
	ch <- prometheus.MustNewConstMetric(descLinks, prometheus.GaugeValue, float64(len(d.Links())))
	lsm := 0.0
	if d.LSMErr() == nil {
		lsm = 1
	}
	ch <- prometheus.MustNewConstMetric(descLSM, prometheus.GaugeValue, lsm)
	// The sizes the agent wrote: walking members (up to 262,144 entries,
	// a syscall per key and per value) on every scrape cost more than the
	// scrape is worth. A map whose last write failed part-way is counted.
	for _, m := range []string{"exempt_conn", "exempt_lis", "local_addrs", "cluster_nets", "unenforced_nets", "members"} {
		n, ok := d.MapSize(m)
		v := float64(n)
		if !ok {
			v = countEntries(d.Map(m))
		}
		ch <- prometheus.MustNewConstMetric(descEntries, prometheus.GaugeValue, v, m)
	}
	es, esErr := d.ReadEventStats()
	if s := c.a.sink; s != nil {
		for outcome, n := range map[string]uint64{"logged": s.Logged.Load(), "suppressed": s.Suppressed.Load(),
			"write_error": s.WriteErrors.Load(), "malformed": s.Malformed.Load()} {
			ch <- prometheus.MustNewConstMetric(descEvents, prometheus.CounterValue, float64(n), outcome)
		}
	}
	if esErr == nil {
		ch <- prometheus.MustNewConstMetric(descEvents, prometheus.CounterValue, float64(es.Lost), "lost")
		ch <- prometheus.MustNewConstMetric(descSamples, prometheus.CounterValue, float64(es.Sampled), "sampled")
		ch <- prometheus.MustNewConstMetric(descSamples, prometheus.CounterValue, float64(es.Unsampled), "over_budget")
	}
	if f := c.a.flows; f != nil {
		ch <- prometheus.MustNewConstMetric(descFlows, prometheus.CounterValue, float64(f.Recorded.Load()), "recorded")
		ch <- prometheus.MustNewConstMetric(descFlows, prometheus.CounterValue, float64(f.Dropped.Load()), "dropped")
		ch <- prometheus.MustNewConstMetric(descFlowProcs, prometheus.CounterValue, float64(f.Enriched.Load()), "named")
		ch <- prometheus.MustNewConstMetric(descFlowProcs, prometheus.CounterValue, float64(f.Unresolved.Load()), "unnamed")
		for _, g := range f.topRefusals(topN) {
			conn := g.Src
			if g.Connector != nil {
				conn = nameOr(g.Connector.User, g.Connector.UID)
			}
			ch <- prometheus.MustNewConstMetric(descTop, prometheus.GaugeValue, float64(g.Count),
				nameOr(g.Listener.User, g.Listener.UID), g.Proto+"/"+strconv.Itoa(int(g.Port)), conn, g.Rule, g.Verdict)
		}
	}
	if g := c.a.grants; g != nil {
		ch <- prometheus.MustNewConstMetric(descGrants, prometheus.GaugeValue, float64(g.count()))
	}
	ch <- prometheus.MustNewConstMetric(descWriteErrors, prometheus.CounterValue, float64(c.a.stateWriteErrors.Load()))
}

func nameOr(name string, id uint32) string {
	if name != "" {
		return name
	}
	return strconv.FormatUint(uint64(id), 10)
}

func (a *agent) metricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector{a})
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}
