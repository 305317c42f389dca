#!/usr/bin/env bash
# Fetch the web page's libraries again (localserve/server/web/vendor/) from npm at pinned versions.
#
#     bash scripts/fetch_web_vendor.sh          # rewrite the vendored files
#     bash scripts/fetch_web_vendor.sh --check  # fail unless the committed files are byte for byte what npm serves
#
# Each package's tarball comes from `npm pack` (the registry's own file, checked by npm against its
# integrity hash); the built files the page imports and each package's license are copied as they are.
# Needs npm; nothing is built, so the copies are the registry's bytes.
set -euo pipefail

MARKED=marked@18.2.1
DOMPURIFY=dompurify@3.5.0
HIGHLIGHT=@highlightjs/cdn-assets@11.12.0
# highlight.js grammars shipped with the page (code fences in other languages are shown unhighlighted)
LANGUAGES=(bash c cpp css go java javascript json markdown python rust shell sql typescript xml yaml)

root="$(cd "$(dirname "$0")/.." && pwd)"
target="$root/localserve/server/web/vendor"
check=false
[[ "${1:-}" == "--check" ]] && check=true

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
out="$work/vendor"
mkdir -p "$out/marked" "$out/dompurify" "$out/highlight/languages"

unpack() {  # unpack <spec> <folder>: the package's tarball from the registry, unpacked into <folder>
    local tarball
    tarball="$(cd "$work" && npm pack --silent "$1" | tail -n 1)"
    mkdir -p "$2"
    tar -xzf "$work/$tarball" -C "$2" --strip-components=1
}

unpack "$MARKED" "$work/marked"
cp "$work/marked/lib/marked.esm.js" "$work/marked/LICENSE" "$out/marked/"

unpack "$DOMPURIFY" "$work/dompurify"
cp "$work/dompurify/dist/purify.es.mjs" "$work/dompurify/LICENSE" "$out/dompurify/"

unpack "$HIGHLIGHT" "$work/highlight"
cp "$work/highlight/es/core.min.js" "$work/highlight/LICENSE" "$out/highlight/"
cp "$work/highlight/styles/github-dark.min.css" "$out/highlight/"
for language in "${LANGUAGES[@]}"; do
    cp "$work/highlight/es/languages/$language.min.js" "$out/highlight/languages/"
done

printf '%s\n' "$MARKED" "$DOMPURIFY" "$HIGHLIGHT" > "$out/VERSIONS"

if $check; then
    diff -r "$out" "$target" && echo "vendor/ matches $MARKED $DOMPURIFY $HIGHLIGHT byte for byte"
else
    rm -rf "$target"
    cp -r "$out" "$target"
    echo "wrote $target"
fi
