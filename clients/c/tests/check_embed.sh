#!/bin/sh
# ctest "embed": a program linked with libkvcached_embed.a (kvcached::kvcached_embed)
# runs, needs no gRPC / protobuf / abseil / libkvcached at run time, exports the
# kvc_* API (so libraries of the program find it with dlsym) and nothing of
# gRPC, protobuf or abseil.
set -eu
exe="$1"
"$exe"
needed=$(readelf -d "$exe" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "NEEDED: $(echo $needed)"
if echo "$needed" | grep -E 'grpc|protobuf|absl|re2|cares|upb|gpr|address_sorting|kvcached|ssl|crypto|libz\.'; then
  echo "check_embed: $exe needs the libraries above at run time" >&2
  exit 1
fi
exported=$(nm -D --defined-only "$exe" | awk '{print $3}')
n=$(echo "$exported" | grep -c '^kvc_' || true)
echo "exported kvc_* functions: $n"
if [ "$n" -lt 40 ]; then
  echo "check_embed: $exe exports $n kvc_* symbols (expected the whole API)" >&2
  exit 1
fi
bad=$(echo "$exported" | c++filt | grep -E 'grpc|absl|protobuf|google|re2::|ares_|upb_|gpr_|deflate|inflate' || true)
if [ -n "$bad" ]; then
  echo "check_embed: $exe exports symbols of its embedded libraries:" >&2
  echo "$bad" | head -20 >&2
  exit 1
fi
echo "check_embed: ok"
