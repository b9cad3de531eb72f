package kvcachedpb

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const installHint = `install the code generators with:
	sudo apt-get install -y protobuf-compiler   # /usr/bin/protoc (scripts/setup.sh does this)
	go install google.golang.org/protobuf/cmd/protoc-gen-go@` + ProtocGenGoVersion + `
	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v` + ProtocGenGoGRPCVersion + `
and make sure $(go env GOPATH)/bin is on PATH (scripts/test-go.sh does all of this)`

// lookTool finds a generator on PATH or in $(go env GOPATH)/bin.
func lookTool(t *testing.T, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	gopath := os.Getenv("GOPATH")
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	for _, dir := range filepath.SplitList(gopath) {
		p := filepath.Join(dir, "bin", name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatalf("%s not found; cannot check that the generated code is up to date;\n%s", name, installHint)
	return ""
}

// The protoc version is part of the generated header; Debian's protoc is
// what we pin, but a different protoc that produces the same code is fine.
var protocLine = regexp.MustCompile(`(?m)^//\s*-?\s*protoc\s+v?\S+\s*$`)

func normalize(b []byte) []byte {
	return protocLine.ReplaceAll(b, []byte("// protoc (version elided)"))
}

// TestGeneratedUpToDate regenerates the package from the proto into a
// temporary directory and compares it with the checked-in files.
func TestGeneratedUpToDate(t *testing.T) {
	protoc := lookTool(t, "protoc")
	genGo := lookTool(t, "protoc-gen-go")
	genGRPC := lookTool(t, "protoc-gen-go-grpc")

	for _, c := range []struct{ bin, want string }{{genGo, ProtocGenGoVersion}, {genGRPC, ProtocGenGoGRPCVersion}} {
		out, err := exec.Command(c.bin, "--version").CombinedOutput()
		if err != nil {
			t.Fatalf("%s --version: %v\n%s", c.bin, err, installHint)
		}
		if !strings.Contains(string(out), c.want) {
			t.Fatalf("%s is %q, the pinned version is %s;\n%s", c.bin, strings.TrimSpace(string(out)), c.want, installHint)
		}
	}

	protos, err := filepath.Abs("../../../../protos")
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	const mod = "github.com/kvcached/kvcached-service/clients/go"
	cmd := exec.Command(protoc, "-I", protos,
		"--plugin=protoc-gen-go="+genGo, "--plugin=protoc-gen-go-grpc="+genGRPC,
		"--go_out="+tmp, "--go_opt=module="+mod,
		"--go-grpc_out="+tmp, "--go-grpc_opt=module="+mod,
		"kvcached/v1/kvcached.proto")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("protoc failed: %v\n%s", err, out)
	}
	for _, name := range []string{"kvcached.pb.go", "kvcached_grpc.pb.go"} {
		fresh, err := os.ReadFile(filepath.Join(tmp, "internal", "kvcachedpb", name))
		if err != nil {
			t.Fatal(err)
		}
		have, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(normalize(fresh), normalize(have)) {
			t.Errorf("internal/kvcachedpb/%s is out of date with protos/kvcached/v1/kvcached.proto; run `go generate ./...` in clients/go", name)
		}
	}
}
