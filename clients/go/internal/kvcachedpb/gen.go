// Package kvcachedpb holds the Go code generated from
// protos/kvcached/v1/kvcached.proto. It is internal: the public API of the
// client module never exposes these types.
//
// Regenerate with `go generate ./...` from clients/go (needs /usr/bin/protoc
// and the plugins pinned in tools.go; scripts/test-go.sh installs them).
// TestGeneratedUpToDate fails when this package is out of date.
package kvcachedpb

//go:generate protoc -I ../../../../protos --go_out=../.. --go_opt=module=github.com/kvcached/kvcached-service/clients/go --go-grpc_out=../.. --go-grpc_opt=module=github.com/kvcached/kvcached-service/clients/go kvcached/v1/kvcached.proto

// Plugin versions this package is generated with. scripts/test-go.sh
// installs exactly these:
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.10
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
const (
	ProtocGenGoVersion     = "v1.36.10"
	ProtocGenGoGRPCVersion = "1.5.1"
)
