# Palisade: two static binaries. bin/palisade is the product (agent, CLI);
# bin/palisade-lab is the lab (testbed, check, bench, vm, probe) and runs the
# product on its nodes. `make demo` and `make test` are the README's first two
# commands and must work on a fresh machine of this kind.
GO      ?= go
BIN     := bin/palisade
LAB     := bin/palisade-lab
GOFLAGS := -trimpath
export CGO_ENABLED := 0

# The version stamped into the binary (palisade version): the release tag
# (v1.2.3 -> 1.2.3), else 0.0.0~N.gHASH (N commits: later builds sort higher
# for dpkg and rpm). The build date is the commit's, or SOURCE_DATE_EPOCH's,
# so that a rebuild of one commit gives the same binary and packages.
VERSION ?= $(shell git describe --tags --match 'v[0-9]*' --dirty 2>/dev/null | sed 's/^v//; s/-\([0-9]*\)-g/+\1.g/; s/-dirty$$/.dirty/')
ifeq ($(VERSION),)
VERSION := $(shell git rev-list --count HEAD 2>/dev/null | sed 's/^/0.0.0~/')$(shell git rev-parse --short=12 HEAD 2>/dev/null | sed 's/^/.g/')$(shell git diff --quiet HEAD -- 2>/dev/null || echo .dirty)
endif
COMMIT     ?= $(shell git rev-parse HEAD 2>/dev/null)
BUILD_DATE ?= $(shell if [ -n "$$SOURCE_DATE_EPOCH" ]; then date -u -d @$$SOURCE_DATE_EPOCH +%Y-%m-%dT%H:%M:%SZ; else TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null; fi)
VPKG    := github.com/palisade-hpc/palisade/internal/version
LDFLAGS := -X $(VPKG).version=$(VERSION) -X $(VPKG).commit=$(COMMIT) -X $(VPKG).date=$(BUILD_DATE)

.PHONY: all build deps generate demo test unit lint lint-imports vm-kernel package clean

include internal/dataplane/uvn/spank/spank.mk

all: build

deps:
	.ci/deps

# eBPF objects are compiled from C with clang and embedded by bpf2go.
generate:
	$(GO) generate ./...

build: generate $(SPANK_SO)
	$(GO) build $(GOFLAGS) -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/palisade
	$(GO) build $(GOFLAGS) -ldflags "$(LDFLAGS)" -o $(LAB) ./cmd/palisade-lab

# .deb and .rpm in dist/ (nfpm as a Go library; docs/deploy.md).
package: build
	$(GO) run ./packaging/mkpkg -version '$(VERSION)' -date '$(BUILD_DATE)' -bin $(BIN) -spank-so $(SPANK_SO) -out dist

# The uvn VM's guest kernel (Debian's, downloaded once into /var/cache/palisade/vm).
vm-kernel: build
	./$(LAB) vm kernel

# staticcheck is a tool dependency pinned in go.mod (`go tool staticcheck`).
lint: lint-imports
	gofmt -l . | (! grep .)
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# The product never imports the lab: no package of cmd/palisade or internal/
# may depend on lab/... (and the product binary carries no plotting library).
MODULE := $(shell $(GO) list -m)
lint-imports:
	@bad=$$($(GO) list -f '{{.ImportPath}}: {{join .Deps " "}}' ./cmd/palisade ./internal/... \
		| tr ' ' '\n' | grep -E '^$(MODULE)/lab(/|$$)|^gonum.org/' | sort -u); \
	if [ -n "$$bad" ]; then \
		echo "product packages depend on the lab or a plotting library:"; \
		$(GO) list -f '{{.ImportPath}}: {{join .Deps " "}}' ./cmd/palisade ./internal/... \
			| grep -E ' $(MODULE)/lab(/| |$$)| gonum.org/' | cut -d: -f1 | sed 's/^/  /'; \
		echo "  depends on: $$bad"; exit 1; \
	fi

# The demo: the same simulated cluster first as today's shared cluster (every
# listener open to every user), then with the userwall agent on every node.
PAL := ./$(LAB)
demo: deps build
	@$(PAL) testbed down >/dev/null 2>&1 || true
	@echo "== 1. A 3-node cluster (Slurm, munge, sshd, OpenMPI; users alice, bob, carol, svc) without Palisade"
	$(PAL) testbed up
	@echo "== 2. Without Palisade every listener is open to every user (mode none: expect all open)"
	$(PAL) check --mode none --quiet
	@echo "== 3. The same cluster judged by Palisade's policy: every mismatch is a leak between users"
	-$(PAL) check --mode userwall --quiet --max-mismatches 10
	@echo "== 4. With the userwall agent (eBPF) on every node"
	$(PAL) testbed down
	$(PAL) testbed up --mode userwall
	$(PAL) testbed exec node1 -- palisade status
	$(PAL) check --mode userwall --quiet
	$(PAL) testbed down
	@echo "== Demo passed: open without Palisade, isolated with it."

unit: build
	$(GO) test -short ./...

# Integration tests need root: they bring up real namespaces, Slurm and BPF.
test: deps build lint vm-kernel
	$(GO) test -count=1 -timeout 30m ./...

clean:
	rm -rf bin dist
