package bench

// Plan holds every size, count and duration of a run. Quick and full runs
// measure the same things; quick uses fewer points, shorter runs and fewer
// rounds so that it finishes in about two minutes.
type Plan struct {
	Rounds       int    `json:"rounds"`
	IperfSeconds int    `json:"iperf_seconds"`
	IperfOmit    int    `json:"iperf_omit_seconds"`
	Streams      []int  `json:"streams"`          // across nodes
	LocalStreams []int  `json:"local_streams"`    // on localhost
	UDPRate      string `json:"udp_offered_load"` // "" = no UDP test
	UDPLen       int    `json:"udp_datagram_bytes"`
	// UDP suite: datagram sizes, sending time of each rate test and
	// round trips of each UDP round-trip test.
	DgramSizes   []int   `json:"dgram_sizes"`
	DgramSeconds float64 `json:"dgram_seconds"`
	DgramIters   int     `json:"dgram_iterations"`
	RRSizes      []int   `json:"rr_sizes"`
	RRIters      int     `json:"rr_iterations"`
	ConnThreads  []int   `json:"conn_threads"`
	ConnPerThr   int     `json:"conn_per_thread"`
	MPISizes     []int   `json:"mpi_sizes"`
	MPIIters     int     `json:"mpi_iterations"`
	MPINodes     []int   `json:"mpi_nodes"`
	ScaleUsers   []int   `json:"scale_users"`      // userwall: concurrent users
	ScaleConns   int     `json:"scale_conns_user"` // connections per user
	HoldConns    []int   `json:"hold_conns"`       // userwall: live idle connections
	SetupUsers   []int   `json:"setup_users"`      // uvn: users on a node
	EgressXfers  []int   `json:"egress_transfers"`
	// Real applications (suite apps; AppSeconds 0 = not measured): pgbench
	// seconds, iperf3 UDP datagram sizes, redis-benchmark requests, MPI
	// allreduce sizes, bytes of the HTTP/3 transfer.
	AppSeconds       int   `json:"app_seconds,omitempty"`
	AppUDPLens       []int `json:"app_udp_bytes,omitempty"`
	AppRedisRequests int   `json:"app_redis_requests,omitempty"`
	AppMPISizes      []int `json:"app_mpi_sizes,omitempty"`
	AppH3Bytes       int   `json:"app_h3_bytes,omitempty"`
}

// QuickPlan is `palisade-lab bench --quick`.
func QuickPlan() Plan {
	return Plan{
		Rounds:       2,
		IperfSeconds: 1,
		IperfOmit:    0,
		Streams:      []int{1, 4},
		LocalStreams: []int{1},
		UDPRate:      "200M",
		UDPLen:       1400,
		DgramSizes:   []int{64, 1024},
		DgramSeconds: 0.5,
		DgramIters:   300,
		RRSizes:      []int{1, 1024, 65536},
		RRIters:      200,
		ConnThreads:  []int{1, 4},
		ConnPerThr:   200,
		MPISizes:     []int{8, 65536},
		MPIIters:     50,
		MPINodes:     []int{2},
		ScaleUsers:   []int{1, 8},
		ScaleConns:   100,
		HoldConns:    []int{0, 500},
		SetupUsers:   []int{5},
		EgressXfers:  []int{1, 2},
	}
}

// FullPlan is the committed run, sized to finish in about half an hour
// on the 2-vCPU machine with every mode (uvn under emulation included).
func FullPlan() Plan {
	return Plan{
		Rounds:       3,
		IperfSeconds: 2,
		IperfOmit:    1,
		Streams:      []int{1, 2, 4, 8},
		LocalStreams: []int{1, 4},
		UDPRate:      "500M",
		UDPLen:       1400,
		DgramSizes:   []int{64, 1024},
		DgramSeconds: 1,
		DgramIters:   1000,
		RRSizes:      []int{1, 16, 64, 256, 1024, 4096, 16384, 65536},
		RRIters:      1000,
		ConnThreads:  []int{1, 2, 4, 8, 16},
		ConnPerThr:   1000,
		MPISizes:     []int{1, 8, 64, 512, 4096, 32768, 262144, 1048576, 4194304},
		MPIIters:     200,
		MPINodes:     []int{2, 3},
		ScaleUsers:   []int{1, 8, 32},
		ScaleConns:   200,
		HoldConns:    []int{0, 10000},
		// 1,000 users take about an hour under the VM's software
		// emulation (~2 s per setup); sites with a VRF kernel or KVM run
		// `--setup-users 10,100,1000`.
		SetupUsers:       []int{10, 30},
		EgressXfers:      []int{1, 10},
		AppSeconds:       5,
		AppUDPLens:       []int{1400, 8000},
		AppRedisRequests: 20000,
		AppMPISizes:      []int{8, 65536, 1048576},
		AppH3Bytes:       4 << 20,
	}
}
