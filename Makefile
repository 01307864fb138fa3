# Palisade: one static binary. `make demo` and `make test` are the README's
# first two commands and must work on a fresh machine of this kind.
GO      ?= go
BIN     := bin/palisade
GOFLAGS := -trimpath
export CGO_ENABLED := 0

.PHONY: all build deps generate demo test unit integration lint clean

all: build

deps:
	.ci/deps

# eBPF objects are compiled from C with clang and embedded by bpf2go.
generate:
	$(GO) generate ./...

build: generate
	$(GO) build $(GOFLAGS) -o $(BIN) ./cmd/palisade

lint:
	gofmt -l . | (! grep .)
	$(GO) vet ./...

demo: deps build
	./$(BIN) testbed down >/dev/null 2>&1 || true
	./$(BIN) testbed up
	./$(BIN) check --mode none || true
	./$(BIN) testbed down

unit: build
	$(GO) test -short ./...

# Integration tests need root: they bring up real namespaces, Slurm and BPF.
test: deps build lint
	$(GO) test -count=1 -timeout 30m ./...

clean:
	rm -rf bin
