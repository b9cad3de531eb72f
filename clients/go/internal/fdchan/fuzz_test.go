package fdchan

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

// FuzzDecode is the Go decoder's coverage-guided fuzz target (docs/fuzzing.md;
// scripts/test-fuzz.sh runs it with go test -fuzz). Input, as the Python and C
// targets read it: [nfds u8][flags u8][record]. Seeds: the shared wire vectors
// (protos/kvcached/v1/fdchannel.vectors.json) and the committed corpus
// (tests/fuzz/corpus/go_fdchannel, raw files). A finding is a panic, an error
// that is not ErrProtocol, a *MalformedRequest without its fault, a record
// out of the limits, or a decoded record that does not survive Encode and
// Decode again unchanged, or an input that takes over 10 s.
func FuzzDecode(f *testing.F) {
	root := "../../../../"
	if data, err := os.ReadFile(filepath.Join(root, "protos/kvcached/v1/fdchannel.vectors.json")); err == nil {
		var vf vectorFile
		if err := json.Unmarshal(data, &vf); err != nil {
			f.Fatal(err)
		}
		for _, v := range append(vf.Vectors, vf.Unexpected...) {
			rec, err := hex.DecodeString(v.Hex)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(append([]byte{byte(min(v.FDs, 255)), 0}, rec...))
		}
	} else {
		f.Fatalf("the shared vectors: %v", err)
	}
	files, _ := filepath.Glob(filepath.Join(root, "tests/fuzz/corpus/go_fdchannel/*"))
	for _, p := range files {
		data, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 2 {
			return
		}
		nfds, rec := int(in[0]), in[2:]
		// Go's engine has no per-input timeout: an input that takes over
		// 10 s panics the worker, which the engine reports with the input
		hang := time.AfterFunc(10*time.Second, func() { panic(fmt.Sprintf("Decode of %d bytes took over 10 s", len(rec))) })
		defer hang.Stop()
		r, err := Decode(rec, nfds)
		if err != nil {
			if r != nil {
				t.Fatalf("a record (%T) and an error: %v", r, err)
			}
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("an error that is not ErrProtocol: %v", err)
			}
			var m *MalformedRequest
			if errors.As(err, &m) && (m.Kind == "" || m.Fault == "" || len(rec) < HeaderSize+8) {
				t.Fatalf("a malformed request without its kind, fault or req_id: %+v", m)
			}
			return
		}
		switch x := r.(type) {
		case Pages:
			if len(x.PageIDs) != nfds || nfds > MaxFDs || uint64(x.FirstIndex)+uint64(nfds) > uint64(x.Total) {
				t.Fatalf("PAGES of %d ids with %d fds, first %d of %d", len(x.PageIDs), nfds, x.FirstIndex, x.Total)
			}
		case Adopt:
			if len(x.PageIDs) != nfds || nfds > MaxFDs {
				t.Fatalf("ADOPT of %d ids with %d fds", len(x.PageIDs), nfds)
			}
		case FreeReq:
			if len(x.PageIDs) > MaxFreeIDs {
				t.Fatalf("FREE of %d ids", len(x.PageIDs))
			}
		case Drop:
			if len(x.PageIDs) == 0 || len(x.PageIDs) > MaxDropIDs {
				t.Fatalf("DROP of %d ids", len(x.PageIDs))
			}
		}
		// what was decoded encodes to a record that decodes to the same
		again, err := Decode(Encode(r), nfds)
		if err != nil || !reflect.DeepEqual(again, r) {
			t.Fatalf("decoded %#v; encoded and decoded again: %#v, %v", r, again, err)
		}
	})
}
